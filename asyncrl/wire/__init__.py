"""The wire: every message, its codec, the ZeroMQ sockets and the controller's RPC plane."""
