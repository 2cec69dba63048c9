"""hloserve._transport: the patches to grpclib, h2, hpack and trio-asyncio."""
