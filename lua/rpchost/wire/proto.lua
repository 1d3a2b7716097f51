-- rpchost.wire.proto: frame types and flags on the wire (see host/net/frame.h).
-- HELLO and HELLO_ACK keep their layout in every protocol version.
return {
  HELLO = 1, HELLO_ACK = 2,
  REQUEST = 3, RESPONSE = 4,
  MESSAGE = 5, -- one-way, keyed: collectives and point-to-point send/recv
  STORE = 10, STORE_REPLY = 11,
  FLAG_ERROR = 1,
  -- (a store request whose answer nobody reads: the store sends none, since a
  -- reply that reaches a process leaving makes its kernel reset the connection)
  FLAG_NO_REPLY = 2,
}
