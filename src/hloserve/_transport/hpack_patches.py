"""hpack 4.x's Huffman encoder in linear time, for hloserve's own connections
(`hloserve._transport.h2_limits.LimitedH2Connection`); no other hpack user in the process is touched.

`hpack.huffman.HuffmanEncoder.encode` shifts one growing integer left by each byte's code, so
encoding an n-byte header value costs O(n^2): 0.45 s for the 100 KB `grpc-message` of an error
quoting a client's long name, minutes at 1 MB (h2 Huffman-encodes every header it sends).
Status messages are bounded now (`hloserve.api.status`), but a header a server sends should not
cost quadratic time, so `LinearHuffmanEncoder` joins each byte's code as a string of bits and
converts once. Same output, byte for byte. Not filed upstream (python-hyper/hpack): the same
fix, `HuffmanEncoder.encode` building a bit string (or a bytearray) instead of one big integer.
"""

from __future__ import annotations

import functools

from hpack.huffman import HuffmanEncoder

from hloserve._transport.requirements import Requires, check

__all__ = ["REQUIRES", "LinearHuffmanEncoder", "install"]

REQUIRES = Requires(
    __name__,
    "hpack",
    "4.2.0",
    members=(
        "hpack.hpack.Encoder.huffman_coder",
        "hpack.huffman.HuffmanEncoder.huffman_code_list",
        "hpack.huffman.HuffmanEncoder.huffman_code_list_lengths",
    ),
    parameters={
        "hpack.huffman.HuffmanEncoder.__init__": ("self", "huffman_code_list", "huffman_code_list_lengths"),
        "hpack.huffman.HuffmanEncoder.encode": ("self", "bytes_to_encode"),
    },
)


class LinearHuffmanEncoder(HuffmanEncoder):
    """hpack's Huffman encoder, in time linear in the length of what it encodes."""

    def __init__(self, huffman_code_list: list[int], huffman_code_list_lengths: list[int]) -> None:
        super().__init__(huffman_code_list, huffman_code_list_lengths)
        self.bit_strings = _bit_strings(tuple(huffman_code_list), tuple(huffman_code_list_lengths))

    def encode(self, bytes_to_encode: bytes | None) -> bytes:
        if not bytes_to_encode:
            return b""
        bits = "".join(map(self.bit_strings.__getitem__, bytes_to_encode))
        bits += "1" * (-len(bits) % 8)  # pad to an octet with the EOS prefix, as RFC 7541 5.2 asks
        return int(bits, 2).to_bytes(len(bits) // 8, "big")


@functools.cache
def _bit_strings(codes: tuple[int, ...], lengths: tuple[int, ...]) -> list[str]:
    """Each byte's code as a string of bits: one table for every connection (a table of its own
    was 257 strings, ~18 KB, per connection: 1 MB on a node's worker behind Envoy)."""
    return [format(code, f"0{length}b") for code, length in zip(codes, lengths, strict=True)]


@functools.cache
def install() -> None:
    """Check that hpack is the version this was written for; nothing is replaced."""
    check(REQUIRES)
