"""grpclib's protobuf codec, with a request's unknown fields dropped in C before betterproto2.

betterproto2 0.10.0 appends each unknown field to a bytes object (`_unknown_fields += raw`): a
request of many small unknown fields costs time quadratic in its size (600 KB: seconds), and even
without that a field costs about a microsecond of Python. So for each betterproto2 message class
the codec builds, once, a google.protobuf (upb) mirror of its known fields from betterproto2's
own field table; a request is parsed by the mirror, its unknown fields are discarded, and the
known ones re-serialized for betterproto2. Malformed wire data raises ValueError, which the
server's receive path answers INVALID_ARGUMENT naming the RPC. The hot path's google.protobuf
messages go straight through, a large ModelInferRequest with its tensors left in the bytes
received (`hloserve.api.viewed_request`).

Answers go out the same way where their shape allows: a betterproto2 message whose fields are all
plain (scalars, strings, enums, repeated ones, repeated plain messages; no map, oneof, optional,
wrapper or singular message field) is copied into its mirror and serialized by upb, the same
bytes at a tenth of the cost or less. RepositoryIndex at 10,000 models took half a second of the
serving loop in betterproto2.
"""

from __future__ import annotations

import functools
from typing import Any

import betterproto2
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message
from grpclib.encoding.proto import ProtoCodec

from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve.api.viewed_request import VIEW_FROM_BYTES, parse_viewed

__all__ = ["KnownFieldsCodec"]

_Field = descriptor_pb2.FieldDescriptorProto
# Same wire encoding, no checks that betterproto2 does not make itself: an enum as int32 (open,
# as in proto3), a string as bytes (betterproto2 checks its UTF-8).
_WIRE_TYPE = {betterproto2.TYPE_ENUM: _Field.TYPE_INT32, betterproto2.TYPE_STRING: _Field.TYPE_BYTES}
_PACKED = frozenset(betterproto2.PACKED_TYPES)


class KnownFieldsCodec(ProtoCodec):
    """`ProtoCodec` whose betterproto2 requests reach the handler without unknown fields."""

    def __init__(self) -> None:
        self._mirrors: dict[type[betterproto2.Message], type[Message]] = {}

    def encode(self, message: Any, message_type: Any) -> bytes:  # as grpclib's codecs: any message class
        if (
            isinstance(message, message_type)
            and isinstance(message, betterproto2.Message)
            and _plain(type(message))
        ):
            out = self._mirror_of(type(message))()
            _copy_plain(message, out)
            return out.SerializeToString()
        return super().encode(message, message_type)

    def _mirror_of(self, message_type: type[betterproto2.Message]) -> type[Message]:
        mirror = self._mirrors.get(message_type)
        if mirror is None:
            mirror = self._mirrors[message_type] = _mirror(message_type)
        return mirror

    def decode(self, data: bytes, message_type: Any) -> Any:  # as grpclib's codecs: any message class
        if message_type is hot.ModelInferRequest and len(data) >= VIEW_FROM_BYTES:
            return parse_viewed(data)
        if not issubclass(message_type, betterproto2.Message):
            return super().decode(data, message_type)
        mirror = self._mirror_of(message_type)
        try:
            known = mirror.FromString(data)
        except DecodeError:
            raise ValueError("malformed protobuf wire data") from None
        known.DiscardUnknownFields()  # type: ignore[attr-defined]  # upb has it, typeshed not
        return message_type.parse(known.SerializeToString())  # ValueError: a string not UTF-8


def _mirror(root: type[betterproto2.Message]) -> type[Message]:
    """A google.protobuf class with `root`'s fields (and, recursively, its messages'), proto2 so
    that every singular field keeps its presence through the re-serialization."""
    file = descriptor_pb2.FileDescriptorProto(name="mirror.proto", package="mirror", syntax="proto2")
    names: dict[type, str] = {}

    def message(cls: type[betterproto2.Message]) -> str:
        if cls not in names:
            names[cls] = f"M{len(file.message_type)}"
            described = file.message_type.add(name=names[cls])
            table: betterproto2.ProtoClassMetadata = cls._betterproto  # type: ignore[arg-type]
            groups: dict[str, int] = {}
            for name, meta in table.meta_by_field_name.items():
                field = described.field.add(name=name, number=meta.number, label=_Field.LABEL_OPTIONAL)
                if meta.proto_type == betterproto2.TYPE_MAP:
                    assert meta.map_meta is not None
                    field.label = _Field.LABEL_REPEATED
                    field.type = _Field.TYPE_MESSAGE
                    field.type_name = entry(meta.map_meta, table.cls_by_field.get(f"{name}.value"))
                else:
                    describe(field, meta.proto_type, table.cls_by_field.get(name))
                    if meta.repeated:
                        field.label = _Field.LABEL_REPEATED
                        field.options.packed = meta.proto_type in _PACKED
                if meta.group:
                    field.oneof_index = groups.setdefault(meta.group, len(groups))
            for group in groups:
                described.oneof_decl.add(name=group)
        return f".mirror.{names[cls]}"

    def entry(metas: tuple[betterproto2.FieldMetadata, ...], value_cls: type | None) -> str:
        described = file.message_type.add(name=f"M{len(file.message_type)}")
        for meta, cls in zip(metas, (None, value_cls), strict=True):
            field = described.field.add(name=f"f{meta.number}", number=meta.number)
            field.label = _Field.LABEL_OPTIONAL
            describe(field, meta.proto_type, cls)
        return f".mirror.{described.name}"

    def describe(field: _Field, proto_type: str, cls: type | None) -> None:
        if proto_type == betterproto2.TYPE_MESSAGE:
            assert cls is not None
            field.type = _Field.TYPE_MESSAGE
            field.type_name = message(cls)
        else:
            field.type = _WIRE_TYPE.get(proto_type) or getattr(_Field, f"TYPE_{proto_type.upper()}")

    message(root)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("mirror.M0"))


@functools.cache
def _plain(cls: type[betterproto2.Message]) -> bool:
    """Whether every field of `cls` (and of its messages) copies field by field (module docstring)."""
    table: betterproto2.ProtoClassMetadata = cls._betterproto  # type: ignore[arg-type]
    for name, meta in table.meta_by_field_name.items():
        if meta.map_meta is not None or meta.group or meta.optional or meta.unwrap:
            return False
        if meta.proto_type == betterproto2.TYPE_MESSAGE and not (
            meta.repeated and _plain(table.cls_by_field[name])
        ):
            return False
    return True


@functools.cache
def _fields(cls: type[betterproto2.Message]) -> tuple[tuple[str, str, bool], ...]:
    """(name, proto type, repeated) of each field of a plain message class."""
    table: betterproto2.ProtoClassMetadata = cls._betterproto  # type: ignore[arg-type]
    return tuple(
        (name, meta.proto_type, bool(meta.repeated)) for name, meta in table.meta_by_field_name.items()
    )


def _copy_plain(message: betterproto2.Message, out: Any) -> None:
    """Set on the mirror `out` what betterproto2 would write of `message` (proto3: a field at its
    default value is not written); strings go as UTF-8 bytes, as the mirror declares them."""
    for name, proto_type, repeated in _fields(type(message)):
        value = getattr(message, name)
        if repeated:
            if proto_type == betterproto2.TYPE_MESSAGE:
                target = getattr(out, name)
                for item in value:
                    _copy_plain(item, target.add())
            elif proto_type == betterproto2.TYPE_STRING:
                getattr(out, name).extend(v.encode() for v in value)
            else:
                getattr(out, name).extend(value)
        elif value:
            setattr(out, name, value.encode() if proto_type == betterproto2.TYPE_STRING else value)
