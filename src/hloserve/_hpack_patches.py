"""hpack 4.x's Huffman encoder in linear time.

`hpack.huffman.HuffmanEncoder.encode` shifts one growing integer left by each byte's code, so
encoding an n-byte header value costs O(n^2): 0.45 s for the 100 KB `grpc-message` of an error
quoting a client's long name, minutes at 1 MB (grpclib Huffman-encodes every header it sends).
Status messages are bounded now (`hloserve._status`), but a header a server sends should not
cost quadratic time, so the encoder here joins each byte's code as a string of bits and converts
once. Same output, byte for byte. To report upstream (python-hyper/hpack): the same fix.
"""

from __future__ import annotations

from hpack.huffman import HuffmanEncoder

__all__ = ["install"]


def _encode(self: HuffmanEncoder, bytes_to_encode: bytes | None) -> bytes:
    if not bytes_to_encode:
        return b""
    codes: list[str] | None = self.__dict__.get("_bit_strings")
    if codes is None:
        pairs = zip(self.huffman_code_list, self.huffman_code_list_lengths, strict=True)
        codes = self.__dict__["_bit_strings"] = [format(code, f"0{length}b") for code, length in pairs]
    bits = "".join(map(codes.__getitem__, bytes_to_encode))
    bits += "1" * (-len(bits) % 8)  # pad to an octet with the EOS prefix, as RFC 7541 5.2 asks
    return int(bits, 2).to_bytes(len(bits) // 8, "big")


def install() -> None:
    """Replace the encoder's method; idempotent and process-wide."""
    HuffmanEncoder.encode = _encode  # type: ignore[method-assign]
