"""The adaptations of the transport libraries (h2, hpack, grpclib, trio-asyncio,
asyncio) hloserve relies on, each checking the versions it was written for."""
