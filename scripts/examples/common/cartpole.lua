-- examples/common/cartpole.lua: CartPole written in Lua with gym's dynamics
-- (gym/envs/classic_control/cartpole.py: Euler steps of 0.02 s, a pole of half
-- length 0.5 on a cart of mass 1, a push of +-10 N, failure past 12 degrees or
-- 2.4 units, reward 1 per step) and CartPole-v1's limit of 500 steps. The RL
-- examples need an environment and gym is Python: this one has its own random
-- generator (seeded per environment, like env.seed) so that episodes do not
-- depend on other users of math.random. Actions are Lua indices, as
-- Categorical's samples are: 1 pushes left, 2 pushes right (gym's 0 and 1).
local tensor = require "tensor"

local CartPole = {}
CartPole.__index = CartPole

local GRAVITY, MASSCART, MASSPOLE = 9.8, 1.0, 0.1
local TOTAL_MASS = MASSCART + MASSPOLE
local LENGTH = 0.5
local POLEMASS_LENGTH = MASSPOLE * LENGTH
local FORCE_MAG, TAU = 10.0, 0.02
local THETA_THRESHOLD = 12 * 2 * math.pi / 360
local X_THRESHOLD = 2.4

-- a small linear congruential generator: reproducible, and private to the env
local function lcg(seed)
  local s = ((seed or 0) * 7919 + 12345) % 2147483647
  if s <= 0 then s = s + 2147483646 end
  return function()
    s = (s * 16807) % 2147483647
    return s / 2147483647
  end
end

function CartPole.new(opts)
  opts = opts or {}
  return setmetatable({max_episode_steps = opts.max_episode_steps or 500, rand = lcg(opts.seed or 543)}, CartPole)
end

function CartPole:seed(s) self.rand = lcg(s) end

-- the observation as a 1-D float32 tensor of 4 (like gym's numpy array)
function CartPole:obs()
  return tensor.tensor({self.x, self.x_dot, self.theta, self.theta_dot})
end

function CartPole:reset()
  local r = self.rand
  self.x, self.x_dot = r() * 0.1 - 0.05, r() * 0.1 - 0.05
  self.theta, self.theta_dot = r() * 0.1 - 0.05, r() * 0.1 - 0.05
  self.steps = 0
  return self:obs()
end

-- action 1 pushes left, 2 pushes right; returns state, reward, done
function CartPole:step(action)
  assert(action == 1 or action == 2, "CartPole: action must be 1 (left) or 2 (right)")
  local force = action == 2 and FORCE_MAG or -FORCE_MAG
  local costheta, sintheta = math.cos(self.theta), math.sin(self.theta)
  local temp = (force + POLEMASS_LENGTH * self.theta_dot ^ 2 * sintheta) / TOTAL_MASS
  local thetaacc = (GRAVITY * sintheta - costheta * temp) /
                   (LENGTH * (4.0 / 3.0 - MASSPOLE * costheta ^ 2 / TOTAL_MASS))
  local xacc = temp - POLEMASS_LENGTH * thetaacc * costheta / TOTAL_MASS
  self.x = self.x + TAU * self.x_dot
  self.x_dot = self.x_dot + TAU * xacc
  self.theta = self.theta + TAU * self.theta_dot
  self.theta_dot = self.theta_dot + TAU * thetaacc
  self.steps = self.steps + 1
  local done = self.x < -X_THRESHOLD or self.x > X_THRESHOLD or self.theta < -THETA_THRESHOLD or
               self.theta > THETA_THRESHOLD or self.steps >= self.max_episode_steps
  return self:obs(), 1.0, done
end

return CartPole
