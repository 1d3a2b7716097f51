/* munge.h: MUNGE, the credential service every Slurm cluster runs, for proving
 * "the same user" between the hosts of a world without a token. libmunge is
 * loaded with dlopen on first use, so rpchost neither links nor needs it.
 *
 * A credential is made by the munged of this host and names the user who asked
 * for it (the kernel tells munged, so it cannot be forged); any munged holding
 * the cluster's key decodes it. rpchost uses one way of it: a payload encoded
 * so that only one user may decode it (MUNGE_OPT_UID_RESTRICTION), and, on
 * decoding, the user who encoded it.
 *
 *   char *cred;
 *   if (rh_munge_encode("secret", 6, getuid(), &cred) != 0) puts(rh_munge_error());
 *   void *buf; int len; long uid, gid;
 *   if (rh_munge_decode(cred, &buf, &len, &uid, &gid) == 0 && uid == (long)getuid()) use(buf, len);
 *   free(buf);
 *   free(cred);
 *
 * Both calls block for one round trip to munged over its Unix-domain socket
 * (RPCHOST_MUNGE_SOCKET, else libmunge's default), about a millisecond. */
#ifndef RH_MUNGE_H
#define RH_MUNGE_H

#include <stddef.h>

#define RH_EMUNGE (-5201) /* libmunge is missing or munged refused: rh_munge_error() says why */

/* The message of the last failure on this thread; never NULL. */
const char *rh_munge_error(void);

/* Loads libmunge (libmunge.so.2). 0 or RH_EMUNGE. */
int rh_munge_load(void);

/* A credential (a NUL-terminated string the caller frees with free()) carrying
 * len bytes of buf, which only a process of uid `decoder` may decode
 * (decoder < 0: any). 0 or RH_EMUNGE. */
int rh_munge_encode(const void *buf, int len, long decoder, char **cred);

/* Decodes a credential: its payload (*buf, freed by the caller with free();
 * NULL when empty) and the uid and gid of the process that made it. A
 * credential decoded before on this host (a replay), expired, or made for
 * another user is refused. 0 or RH_EMUNGE. */
int rh_munge_decode(const char *cred, void **buf, int *len, long *uid, long *gid);

#endif
