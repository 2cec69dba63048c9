"""The adaptations of the transport libraries (h2, hpack, grpclib, h11 under hypercorn,
trio-asyncio, asyncio) hloserve relies on, each checking the versions it was written for."""
