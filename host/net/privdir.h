/* privdir.h: the directory only this user can enter, where a rank keeps its
 * Unix-domain sockets, a world without a token keeps its secret, and the
 * bytecode cache lives.
 *
 * A fixed name in a directory others may write (/tmp/rpchost-<uid>) can be
 * taken first by another user, as a directory of theirs or a symbolic link:
 * every world without a token of this user would then refuse to start. So
 * there are several candidates, tried in order, and the first that is (or can
 * be made) a real directory of this user with mode 0700, in a directory that
 * others cannot rename it out of, is used:
 *
 *   $XDG_RUNTIME_DIR/rpchost
 *   /run/user/<uid>/rpchost       (when /run/user/<uid> is this user's)
 *   /tmp/rpchost-<uid>
 *   $HOME/.cache/rpchost
 *
 * Every process of one world computes the same list from the same
 * environment, so all of them find the same directory. */
#ifndef RH_PRIVDIR_H
#define RH_PRIVDIR_H

#include <stddef.h>

#include "rh.h"

#define RH_PRIVDIR_MAX 4    /* candidates */
#define RH_PRIVDIR_PATH 512 /* bytes of one candidate's path */

/* The candidates for user uid, in order, from the environment's values (NULL
 * or empty: that candidate is skipped), the root of the per-user runtime
 * directories (run_user, normally "/run/user") and the shared temporary
 * directory (tmpdir; NULL or empty: /tmp).
 * Fills out; returns how many. */
int rh_privdir_candidates(const char *xdg, const char *run_user, const char *tmpdir, const char *home, unsigned uid,
                          char out[][RH_PRIVDIR_PATH], int max);

/* Makes path (mode 0700) if it is missing, or an existing directory of this
 * user that others cannot write private (0700); a directory of another user, a
 * symbolic link, one that others can write, or one in a directory where others
 * could replace it is refused. 0, or RH_ENOPRIVDIR with why it is not (one
 * clause, naming path: "/tmp/rpchost-1000 belongs to uid 1001 (mallory)"). */
int rh_privdir_check(const char *path, char *why, size_t whylen);

/* The first of the n candidates that rh_privdir_check accepts: its index, or
 * RH_ENOPRIVDIR with why naming each candidate, what is wrong with it, and what
 * to do. */
int rh_privdir_find(char cands[][RH_PRIVDIR_PATH], int n, char *why, size_t whylen);

/* This process's private directory: the first good candidate for its
 * environment (XDG_RUNTIME_DIR, /run/user, RPCHOST_TMPDIR in place of /tmp for
 * tests, HOME; not TMPDIR: every process of a world must find the same
 * directory, and TMPDIR often differs between them, one per job or session).
 * With sub (a plain name the caller checked; NULL for none), its subdirectory of
 * that name, checked the same way. 0 with the path in out, or RH_ENOPRIVDIR with
 * why (rh_privdir_find's or rh_privdir_check's words). */
int rh_privdir_get(const char *sub, char *out, size_t outlen, char *why, size_t whylen);

/* Removes the socket files (*.sock) of this user in dir that nobody listens on
 * any more (a connect is refused: their rank was killed and could not remove its
 * own) and that are at least min_age seconds old (so that a rank between its bind
 * and its listen keeps its file); compiled modules earlier versions left there
 * (*.luac, regular files of this user) go too, and so do the world secrets of
 * stores that are gone (rh_privdir_hold). Synchronous: a connect to a
 * Unix-domain socket answers at once. Returns how many sockets and secrets it
 * removed (0 when dir cannot be read). */
int rh_privdir_sweep(const char *dir, double min_age);

/* A loopback world's secret file (world-<port>.key, written by its store's
 * host) is held, with a shared lock on it, for as long as the store runs: the
 * lock goes with the process, however it ends, so a file nobody holds is a
 * killed store's and rh_privdir_sweep removes it (with its leftover
 * world-<port>.key.tmp<pid>) like a dead rank's socket. Returns the descriptor
 * holding it (close it to let go), or a negative errno. */
int rh_privdir_hold(const char *path);

#endif
