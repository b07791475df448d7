"""Public test kit: an in-memory datagram network for sans-IO endpoints.

Links have latency, loss and reordering; time is virtual.
"""

from ._network import MemoryNetwork as MemoryNetwork, Pipe as Pipe
