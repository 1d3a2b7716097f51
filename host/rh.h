/* rh.h: what every part of host/ shares: error codes and their messages.
 *
 * host/ is plain C11 with no Lua in it. Functions return 0 or a negative
 * RH_E* code (or a negative libuv code, which rh_strerror also explains);
 * the binding layer turns them into Lua error objects. */
#ifndef RH_H
#define RH_H

#include <stddef.h>
#include <stdint.h>

#define RH_PROTOCOL_VERSION 3

enum {
  RH_OK = 0,
  /* Start well below libuv's codes (which are negated errno values). */
  RH_EBADMAGIC = -5001,  /* a frame did not start with the rpchost magic */
  RH_EVERSION = -5002,   /* a frame carried another protocol version */
  RH_ETOOBIG = -5003,    /* a frame exceeded the configured maximum size */
  RH_ENOMEM = -5004,     /* an allocation failed */
  RH_ECLOSED = -5005,    /* the connection is closed */
  RH_EBADFRAME = -5006,  /* a frame's lengths are inconsistent */
  RH_EFDS = -5007,       /* a peer sent descriptors that its frames do not take */
  RH_EUNPROVEN = -5008,  /* a frame other than the handshake before the peer proved itself */
  RH_EHANDSHAKE = -5009, /* the handshake did not complete within its deadline */
  RH_ERING = -5010,      /* a shared-memory ring's header or contents are impossible */
  RH_EARENA = -5011,     /* a collective arena's header, epoch or signature is impossible */
  RH_ENOKERNEL = -5012,  /* a reduction op has no kernel for the tensor's dtype */
  RH_ECROWDED = -5013,   /* closed: its listener had too many connections waiting to prove themselves */
  RH_ENOPRIVDIR = -5014, /* no private directory of this user could be had (privdir.h) */
  RH_ETRUNCATED = -5015, /* a file ends before the bytes a read asked for (io/atomic_file.h) */
  RH_ESILENT = -5016,    /* the peer's host acknowledged nothing within the liveness bound (conn.c) */
};

/* The message for an RH_E* or libuv error code; never NULL. */
const char *rh_strerror(int code);

#endif
