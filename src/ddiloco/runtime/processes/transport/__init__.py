"""How processes talk: the authenticated wire format, connection authentication at the
handshake, same-host shared memory, the fault-injecting proxy, events on stdout, snapshots."""
