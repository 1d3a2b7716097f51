/* memcpy_tune.h: glibc's memcpy on CPUs where its `rep movsb` path is slow.
 *
 * On AMD CPUs with FSRM (Zen 3 and 4), glibc before 2.39 copies from 2 KiB to
 * about 1 MiB with `rep movsb`, which runs 15-20x slower when the destination
 * lies less than 32 bytes after the source modulo a page (glibc bug 30994):
 * 3 GB/s instead of 45 on this project's VM, for any two tensors that happen to
 * sit so in the heap (a 256 KiB copy: 86 us instead of 6). glibc's own remedy
 * is a tunable, read only when a process starts: the copies then take the
 * vector loop below the non-temporal threshold, and never the slow path. */
#ifndef RH_MEMCPY_TUNE_H
#define RH_MEMCPY_TUNE_H

/* What rh_memcpy_tune found, for rpchost's own report. */
typedef enum {
  RH_MEMCPY_NOT_NEEDED, /* this CPU's rep movsb is not the slow one */
  RH_MEMCPY_TUNED,      /* GLIBC_TUNABLES sets x86_rep_movsb_threshold (ours, or the user's) */
  RH_MEMCPY_OFF,        /* RPCHOST_MEMCPY_TUNE=0 */
  RH_MEMCPY_FAILED,     /* the process could not start itself again with the tunable */
} rh_memcpy_state_t;

/* Called first thing in main, with main's argv: on an affected CPU with a
 * glibc before 2.39, unless RPCHOST_MEMCPY_TUNE=0 or GLIBC_TUNABLES already sets
 * the threshold, adds glibc.cpu.x86_rep_movsb_threshold to GLIBC_TUNABLES, sets
 * RPCHOST_MEMCPY_TUNE=started, and executes this same program again with the
 * same arguments (so it returns only where nothing is to be done, or where that
 * failed); a start that finds "started" but no tunable never starts again.
 * Never in secure mode (setuid, capabilities), nor without a loader, nor under
 * valgrind. The variables stay in the environment, so the processes this one
 * starts (a launcher's ranks) begin tuned. */
void rh_memcpy_tune(char **argv);
rh_memcpy_state_t rh_memcpy_state(void);

#endif
