/* wake_ahead.c: sleeping until just before an answer is due.
 *
 * A rank that waits for an answer polls the rings for a short window and then
 * sleeps; the peer that writes into the ring of a sleeper rings its doorbell,
 * and the kernel's wake-up (tens of microseconds on a small VM, more than the
 * rest of a call) lies between the answer landing and its being seen. When the
 * answers to a call come regularly after the window (a parameter server's
 * forward of a millisecond), the scheduler (lua/rpchost/wake_ahead.lua) knows
 * roughly when the next one is due: it arms this timer for a little before,
 * the kernel's wake-up happens while the peer still works, and the loop then
 * polls the rings (conn_ring.c) for a short spin. The answer is seen as it
 * lands, and its writer, finding the reader awake, rings no doorbell. Only
 * where the rank has a core to itself (rh_net_polite): where ranks outnumber
 * the cores, one that polls takes a core from the rank it waits for.
 *
 * One timerfd per net, on CLOCK_MONOTONIC (uv_hrtime's clock), with
 * nanoseconds where the loop's own timers have milliseconds; its poll handle
 * is unreferenced, so an armed timer keeps no finished loop alive. Polling
 * only happens where rings exist: ranks that talk only over sockets are never
 * armed (rh_net_wake_ahead says so). */
#include <errno.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include "conn_priv.h"

static void fired(uv_poll_t *h, int status, int events) {
  (void)status, (void)events;
  rh_net_t *net = h->data;
  uint64_t n;
  ssize_t got;
  while ((got = read(net->ahead_fd, &n, sizeof n)) < 0 && errno == EINTR) {}
  /* (no expiry to read: a readiness that was not one; disarmed after it
   * fired, before this turn: nothing to do) */
  if (got != (ssize_t)sizeof n || !net->ahead_at) return;
  uint64_t now = uv_hrtime();
  net->ahead_late = now > net->ahead_at ? now - net->ahead_at : 0;
  net->ahead_at = 0;
  net->ahead_until = now + net->ahead_spin_ns;
  rh__rings_start_polling(net);
}

void rh__ahead_init(rh_net_t *net) {
  net->ahead_fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (net->ahead_fd < 0) return;
  if (uv_poll_init(net->loop, &net->ahead, net->ahead_fd)) {
    close(net->ahead_fd);
    net->ahead_fd = -1;
    return;
  }
  net->ahead.data = net;
  uv_unref((uv_handle_t *)&net->ahead);
  if (uv_poll_start(&net->ahead, UV_READABLE, fired)) rh__ahead_close(net);
}

static void closed(uv_handle_t *h) {
  rh_net_t *net = h->data;
  close(net->ahead_fd);
  net->ahead_fd = -1;
}

void rh__ahead_close(rh_net_t *net) {
  if (net->ahead_fd < 0 || uv_is_closing((uv_handle_t *)&net->ahead)) return;
  uv_close((uv_handle_t *)&net->ahead, closed);
}

int rh_net_wake_ahead(rh_net_t *net, uint64_t at, uint64_t spin_ns) {
  if (net->ahead_fd < 0 || uv_is_closing((uv_handle_t *)&net->ahead)) return -EINVAL;
  if (!at) {
    /* (the answer came: polling for it ends too) */
    net->ahead_until = 0;
    if (!net->ahead_at) return 0;
    net->ahead_at = 0;
    struct itimerspec off = {{0, 0}, {0, 0}};
    return timerfd_settime(net->ahead_fd, 0, &off, NULL) ? -errno : 0;
  }
  if (!net->rings) return -EINVAL;
  uint64_t now = uv_hrtime();
  /* (where others want the cores, a rank that polls takes a core from the one
   * it waits for: it sleeps as before) */
  if (rh_net_polite(net, now)) return -EAGAIN;
  if (at <= now) {
    /* (due already: the polling that is under way goes on until then, with no
     * timer; 2 where that end has passed too, and nothing polls) */
    if (at + spin_ns <= now) return 2;
    if (at + spin_ns > net->ahead_until) net->ahead_until = at + spin_ns;
    rh__rings_start_polling(net);
    return 1;
  }
  struct itimerspec when = {{0, 0}, {(time_t)(at / 1000000000u), (long)(at % 1000000000u)}};
  if (timerfd_settime(net->ahead_fd, TFD_TIMER_ABSTIME, &when, NULL)) return -errno;
  net->ahead_at = at;
  net->ahead_spin_ns = spin_ns;
  return 0;
}
