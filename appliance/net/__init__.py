"""Byte transports over sockets, plain and TLS: the one place that reads and writes them.

Theory of operation: the server (appliance/server/) and the upstream client
(appliance/client/) both move bytes on TCP connections, most of them plain, some TLS.
`transport` gives both one interface over either, so every HTTP rule above it is written
once; it owns its sockets outright (made or accepted here, never fished out of another
library's objects). No HTTP in here.
"""
