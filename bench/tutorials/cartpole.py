"""bench/tutorials/cartpole.py: the CartPole of scripts/examples/common/cartpole.lua
(gym's dynamics, CartPole-v1's 500-step limit, the same seeded generator), so
that the PyTorch twins play exactly the environments the rpchost examples play
(gym itself is not installed here)."""
import math

import numpy as np

GRAVITY, MASSCART, MASSPOLE = 9.8, 1.0, 0.1
TOTAL_MASS = MASSCART + MASSPOLE
LENGTH = 0.5
POLEMASS_LENGTH = MASSPOLE * LENGTH
FORCE_MAG, TAU = 10.0, 0.02
THETA_THRESHOLD = 12 * 2 * math.pi / 360
X_THRESHOLD = 2.4


class CartPole:
    def __init__(self, max_episode_steps=500, seed=543):
        self.max_episode_steps = max_episode_steps
        self.seed(seed)

    def seed(self, s):
        st = (s * 7919 + 12345) % 2147483647
        if st <= 0:
            st += 2147483646
        self._s = st

    def _rand(self):
        self._s = (self._s * 16807) % 2147483647
        return self._s / 2147483647

    def _obs(self):
        return np.array([self.x, self.x_dot, self.theta, self.theta_dot], dtype=np.float32)

    def reset(self):
        r = self._rand
        self.x, self.x_dot = r() * 0.1 - 0.05, r() * 0.1 - 0.05
        self.theta, self.theta_dot = r() * 0.1 - 0.05, r() * 0.1 - 0.05
        self.steps = 0
        return self._obs()

    def step(self, action):
        force = FORCE_MAG if action == 1 else -FORCE_MAG
        costheta, sintheta = math.cos(self.theta), math.sin(self.theta)
        temp = (force + POLEMASS_LENGTH * self.theta_dot ** 2 * sintheta) / TOTAL_MASS
        thetaacc = (GRAVITY * sintheta - costheta * temp) / (
            LENGTH * (4.0 / 3.0 - MASSPOLE * costheta ** 2 / TOTAL_MASS))
        xacc = temp - POLEMASS_LENGTH * thetaacc * costheta / TOTAL_MASS
        self.x += TAU * self.x_dot
        self.x_dot += TAU * xacc
        self.theta += TAU * self.theta_dot
        self.theta_dot += TAU * thetaacc
        self.steps += 1
        done = (self.x < -X_THRESHOLD or self.x > X_THRESHOLD or self.theta < -THETA_THRESHOLD
                or self.theta > THETA_THRESHOLD or self.steps >= self.max_episode_steps)
        return self._obs(), 1.0, done, {}
