/* errors.c: the one table of rpchost error messages (libuv's for its codes). */
#include "rh.h"

#include <uv.h>

static const struct {
  int code;
  const char *msg;
} rh__errors[] = {
    {RH_EBADMAGIC, "not an rpchost frame (bad magic): the peer is not rpchost or the stream is corrupt"},
    {RH_EVERSION, "protocol version mismatch"},
    {RH_ETOOBIG, "frame larger than the maximum frame size (RPCHOST_MAX_FRAME)"},
    {RH_ENOMEM, "out of memory"},
    {RH_ECLOSED, "connection closed"},
    {RH_EBADFRAME, "malformed frame header"},
    {RH_EFDS, "the peer sent more file descriptors than its frames take"},
    {RH_EUNPROVEN, "the peer sent a frame other than its handshake before proving itself (closed unread)"},
    {RH_ERING, "corrupt shared-memory ring from the peer (impossible head, tail or frame): connection closed"},
    {RH_EARENA, "corrupt collective arena (impossible header or step from a peer)"},
    {RH_ENOKERNEL, "the reduction op has no kernel for this dtype"},
    {RH_EHANDSHAKE, "the peer did not complete its handshake in time (RPCHOST_HANDSHAKE_TIMEOUT)"},
    {RH_ECROWDED,
     "closed unproven: more connections than RPCHOST_MAX_UNPROVEN were waiting to prove themselves "
     "on this listener, and this was the oldest"},
    {RH_ENOPRIVDIR, "no private directory of this user for sockets and world secrets"},
    {RH_ETRUNCATED, "the file ends before the bytes asked for (truncated)"},
    {RH_ESILENT,
     "its host stopped answering: nothing was acknowledged within RPCHOST_HEARTBEAT seconds (the host is "
     "down, or the network to it is cut)"},
};

const char *rh_strerror(int code) {
  for (size_t i = 0; i < sizeof rh__errors / sizeof rh__errors[0]; i++)
    if (rh__errors[i].code == code) return rh__errors[i].msg;
  if (code < 0 && code > -5000) return uv_strerror(code);
  return "unknown error";
}
