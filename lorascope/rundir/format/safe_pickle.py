"""A pickle reader that builds plain data only, streaming, in bounded extra memory.

Allocator snapshots and flight-recorder dumps are pickles, and a pickle can run any code
on load. This reader interprets the pickle opcodes itself and knows only the ones that
build plain data (None, bools, numbers, strings, bytes, tuples, lists, dicts, sets):
every opcode that imports or calls something (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST,
OBJ, NEWOBJ, EXT*, persistent ids, out-of-band buffers) stops the load with
:class:`UnsafePickleError` before anything is imported or called. Nothing from the
``pickle`` module's loaders is used, so no hook of theirs can be reached either.

Why not ``pickle.Unpickler`` with a refusing ``find_class``: that would be safe too, but
it builds the whole object tree, and a 1 GB allocator snapshot becomes 3-4 GB of Python
objects. This reader reads the file in chunks and shares what the snapshot repeats:

- a list made only of references to earlier objects (``EMPTY_LIST MEMOIZE MARK GET... APPENDS``,
  what torch writes for every trace entry's stack, millions of times) comes back as a
  *tuple*, one shared object per distinct list of references;
- short strings with the same bytes come back as the same object.

Everything else comes back as ``pickle.load`` would build it.

Bounded by the file: only regular files are read; a declared length (strings, bytes, long
integers) longer than what the file still holds is "truncated" before anything is
allocated; the memo never holds more slots than the file has bytes (whatever its indices
say). Every object built takes bytes of the file and containers hold references, so what
a load builds is linear in the file's size.
"""

from __future__ import annotations

import gc
import os
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from lorascope.errors import BadInputError
from lorascope.rundir.format.safe_open import open_regular

#: Bytes read per chunk; the reader refills when fewer than _LOW_WATER remain.
_CHUNK = 8 << 20
_LOW_WATER = 1 << 16
#: Short strings are shared through a cache keyed by their bytes, up to this many.
_STR_CACHE_MAX = 1 << 20
_SHORT_STR = 64
#: Distinct shared reference lists kept (each is one stack in a snapshot), at most.
_SHARED_MAX = 1 << 21

_REF_LIST = re.compile(rb"\](?:\x94|q.|r....)(?:\(((?:h.|j....)+)e|(h.|j....)a)", re.S)

_UNSAFE_NAMES = {
    0x52: "REDUCE (calls an object)",
    0x62: "BUILD (sets an object's state)",
    0x69: "INST (imports and instantiates a class)",
    0x6F: "OBJ (instantiates a class)",
    0x81: "NEWOBJ (instantiates a class)",
    0x92: "NEWOBJ_EX (instantiates a class)",
    0x82: "EXT1 (imports from the extension registry)",
    0x83: "EXT2 (imports from the extension registry)",
    0x84: "EXT4 (imports from the extension registry)",
    0x50: "PERSID (persistent id)",
    0x51: "BINPERSID (persistent id)",
    0x97: "NEXT_BUFFER (out-of-band buffer)",
    0x98: "READONLY_BUFFER (out-of-band buffer)",
}


class PickleFormatError(BadInputError):
    """The file is not a readable pickle (truncated, corrupt, or not a pickle at all)."""


class UnsafePickleError(BadInputError):
    """The pickle asks to import or call something: refused, nothing was run."""


class _Mark:
    """Placeholder for an unfilled memo slot."""


_UNSET = _Mark()


class _Source:
    """Chunked reading of a binary file with the position kept by the caller."""

    def __init__(self, f: BinaryIO | _Copied | None, data: bytes | None = None) -> None:
        self.f: BinaryIO | _Copied | None = f
        self.first = data
        self.eof = f is None
        #: Bytes in the whole input: no declared length and no memo index may exceed it.
        self.size = os.fstat(f.fileno()).st_size if f is not None else len(data or b"")

    def initial(self) -> bytes:
        if self.first is not None:
            return self.first
        return self.more(b"", 0)

    def more(self, buf: bytes, pos: int) -> bytes:
        """The unread rest of ``buf`` plus the next chunk."""
        if self.eof:
            return buf[pos:]
        assert self.f is not None
        chunk = self.f.read(_CHUNK)
        if len(chunk) < _CHUNK:
            self.eof = True
        return buf[pos:] + chunk

    def take(self, buf: bytes, pos: int, n: int) -> tuple[bytes, bytes, int]:
        """``n`` bytes from ``pos`` (reading past the buffer if needed), the buffer, the new position."""
        end = pos + n
        if end <= len(buf):
            return buf[pos:end], buf, end
        parts = [buf[pos:]]
        have = len(parts[0])
        if self.f is not None and n - have > self.size - self.f.tell():
            raise PickleFormatError(f"the pickle is truncated (a value declares {n} bytes, more than the file holds)")
        while have < n and not self.eof:
            assert self.f is not None
            chunk = self.f.read(max(_CHUNK, n - have))
            if not chunk:
                self.eof = True
                break
            parts.append(chunk)
            have += len(chunk)
        data = b"".join(parts)
        if len(data) < n:
            raise PickleFormatError("the pickle is truncated (it ends inside a value)")
        return data[:n], data[n:], 0

    def line(self, buf: bytes, pos: int) -> tuple[bytes, bytes, int]:
        """A newline-terminated argument (protocol 0 text opcodes), without the newline."""
        nl = buf.find(b"\n", pos)
        while nl < 0 and not self.eof:
            buf, pos = self.more(buf, pos), 0
            nl = buf.find(b"\n", pos)
        if nl < 0:
            raise PickleFormatError("the pickle is truncated (a text argument has no end)")
        return buf[pos:nl], buf, nl + 1


def load_pickle(path: Path, copy_to: BinaryIO | None = None, inside: Path | None = None) -> Any:
    """Read a pickle file as plain data; BadInputError subclasses on anything else.
    COPY_TO: a file that receives every byte as it is read, so that a copy holds exactly
    the bytes checked (not the file again, which may have been swapped since). INSIDE: a
    folder the file must not leave (``safe_open.open_regular``)."""
    try:
        with open_regular(path, inside) as f:
            return _load(_Source(f if copy_to is None else _Copied(f, copy_to)), str(path))
    except OSError as exc:
        raise BadInputError(f"{path}: cannot read: {exc.strerror or exc}") from None


class _Copied:
    """A binary file whose reads are also written to another."""

    def __init__(self, f: BinaryIO, copy_to: BinaryIO) -> None:
        self.f, self.copy_to = f, copy_to

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        self.copy_to.write(data)
        return data

    def tell(self) -> int:
        return self.f.tell()

    def fileno(self) -> int:
        return self.f.fileno()


def loads_pickle(data: bytes, name: str = "<bytes>") -> Any:
    """Like :func:`load_pickle`, on bytes in memory."""
    return _load(_Source(None, bytes(data)), name)


@contextmanager
def no_gc() -> Iterator[None]:
    """The cyclic garbage collector off for a while: building millions of containers, none
    in a cycle, it only costs time (each full pass walks the whole heap)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _load(src: _Source, name: str) -> Any:
    try:
        with no_gc():
            return _run(src)
    except (PickleFormatError, UnsafePickleError) as exc:
        raise type(exc)(f"{name}: {exc}") from None
    except IndexError:
        raise PickleFormatError(
            f"{name}: the pickle is truncated or corrupt (it ends too early or refers to something that is not there)"
        ) from None
    except (
        TypeError,
        ValueError,
        KeyError,
        UnicodeDecodeError,
        struct.error,
        OverflowError,
        MemoryError,
        RecursionError,
    ) as exc:
        raise PickleFormatError(f"{name}: not a valid pickle ({exc.__class__.__name__}: {str(exc)[:120]})") from None


def _unsafe(op: int, detail: str = "") -> UnsafePickleError:
    what = detail or _UNSAFE_NAMES.get(op, f"opcode 0x{op:02x}")
    return UnsafePickleError(
        f"refused: the pickle asks to {what}; only plain data is read, nothing was imported or run"
    )


def _pop_mark(stack: list[Any], marks: list[int]) -> list[Any]:
    if not marks:
        raise PickleFormatError("the pickle is corrupt (a MARK is missing)")
    k = marks.pop()
    items = stack[k:]
    del stack[k:]
    return items


def _memo_put(memo: list[Any], idx: int, value: Any, shared: _RefLists) -> None:
    if idx < len(memo):
        if memo[idx] is not _UNSET:
            shared.clear()  # shared reference lists keyed on this slot would be stale
        memo[idx] = value
        return
    if idx > len(memo) + (1 << 24) or idx >= shared.max_memo:
        raise PickleFormatError(f"the pickle is corrupt (memo index {idx} out of range)")
    memo.extend([_UNSET] * (idx - len(memo)))
    memo.append(value)


def _memo_get(memo: list[Any], idx: int) -> Any:
    value = memo[idx]
    if value is _UNSET:
        raise IndexError(idx)
    return value


def _refs(raw: bytes, memo: list[Any]) -> tuple[Any, ...]:
    """Resolve a run of BINGET/LONG_BINGET opcodes to the objects they reference."""
    out = []
    i, n = 0, len(raw)
    while i < n:
        if raw[i] == 0x68:
            out.append(_memo_get(memo, raw[i + 1]))
            i += 2
        else:
            out.append(_memo_get(memo, int.from_bytes(raw[i + 1 : i + 5], "little")))
            i += 5
    return tuple(out)


def _refill_at(buf: bytes, src: _Source) -> int:
    """The position from which the loop refills its buffer (never, once the file is all read)."""
    return len(buf) + 1 if src.eof else len(buf) - _LOW_WATER


class _RefLists:
    """Lists made only of memo references (``EMPTY_LIST MEMOIZE MARK GET... APPENDS``),
    shared as one tuple per distinct run of references.

    Finding where the run ends is the cost. A known run is found without parsing: the run
    ends at one of the next few "e" (APPENDS) bytes, and a known run (a complete sequence
    of GET opcodes) equal to the bytes up to an "e" proves the list ends there, since
    opcodes decode one way only. New runs (and lists written with BINPUT) go through a
    regular expression, then are known.
    """

    def __init__(self, memo: list[Any], max_memo: int) -> None:
        self.memo = memo
        self.known: dict[bytes, tuple[Any, ...]] = {}
        #: Memo slots allowed in total: a memo operation takes at least a byte of the
        #: pickle, so a real pickle never holds more slots than it has bytes (a forged
        #: one could jump the index ahead and grow the memo to gigabytes).
        self.max_memo = max_memo

    def clear(self) -> None:
        self.known.clear()

    def at(self, buf: bytes, start: int) -> tuple[tuple[Any, ...], int] | None:
        """(the shared tuple, position after APPENDS) for a reference list at ``start``
        (its EMPTY_LIST byte), else None. The caller memoizes the tuple."""
        if buf[start + 1] == 0x94 and buf[start + 2] == 0x28:
            first = start + 3
            q = first
            known = self.known
            for _ in range(4):
                q = buf.find(b"e", q + 1)
                if q < 0:
                    break
                value = known.get(buf[first:q])
                if value is not None:
                    return value, q + 1
        m = _REF_LIST.match(buf, start)
        if m is None:
            return None
        raw = m.group(1) or m.group(2)
        value = self.known.get(raw)
        if value is None:
            value = _refs(raw, self.memo)
            if len(self.known) < _SHARED_MAX and m.group(1):
                self.known[raw] = value
        return value, m.end()


def _short_str(buf: bytes, p: int, strings: dict[bytes, str], memo: list[Any]) -> tuple[str, int] | None:
    """SHORT_BINUNICODE at ``p`` followed by MEMOIZE: (the string, position after), else None."""
    n = buf[p + 1]
    end = p + 2 + n
    if buf[end] != 0x94:
        return None
    raw = buf[p + 2 : end]
    value = strings.get(raw)
    if value is None:
        value = raw.decode("utf-8", "surrogatepass")
        if n <= _SHORT_STR and len(strings) < _STR_CACHE_MAX:
            strings[raw] = value
    memo.append(value)
    return value, end + 1


def _flat_dict(
    buf: bytes, start: int, memo: list[Any], shared: _RefLists, strings: dict[bytes, str], limit: int
) -> tuple[dict[Any, Any], int] | None:
    """A dict written as ``EMPTY_DICT MEMOIZE MARK (key value)... SETITEMS`` whose keys and
    values are references, numbers, short strings, None/bools or reference lists (every
    allocator trace entry and stack frame): built here directly, without the generic
    loop's stack. Returns (dict, position after SETITEMS), or None, having undone its memo
    entries, for the generic loop to handle (anything else in it, or near the buffer end).
    """
    mark = len(memo)
    d: dict[Any, Any] = {}
    memo.append(d)
    p = start + 3
    from_bytes = int.from_bytes
    try:
        while p < limit:
            o = buf[p]
            if o == 0x75:  # SETITEMS
                return d, p + 1
            if o == 0x68:
                k = memo[buf[p + 1]]
                p += 2
            elif o == 0x6A:
                k = memo[from_bytes(buf[p + 1 : p + 5], "little")]
                p += 5
            elif o == 0x8C:
                got = _short_str(buf, p, strings, memo)
                if got is None:
                    break
                k, p = got
            else:
                break
            o = buf[p]
            if o == 0x68:
                v = memo[buf[p + 1]]
                p += 2
            elif o == 0x6A:
                v = memo[from_bytes(buf[p + 1 : p + 5], "little")]
                p += 5
            elif o == 0x4B:
                v = buf[p + 1]
                p += 2
            elif o == 0x4D:
                v = buf[p + 1] | buf[p + 2] << 8
                p += 3
            elif o == 0x4A:
                v = from_bytes(buf[p + 1 : p + 5], "little", signed=True)
                p += 5
            elif o == 0x8A:
                n = buf[p + 1]
                v = from_bytes(buf[p + 2 : p + 2 + n], "little", signed=True)
                p += 2 + n
            elif o == 0x8C:
                got = _short_str(buf, p, strings, memo)
                if got is None:
                    break
                v, p = got
            elif o == 0x5D and buf[p + 1] == 0x94:
                found = shared.at(buf, p)
                if found is None:
                    break
                v, p = found
                memo.append(v)
            elif o == 0x4E:
                v = None
                p += 1
            elif o == 0x88 or o == 0x89:
                v = o == 0x88
                p += 1
            else:
                break
            if k is _UNSET or v is _UNSET:
                break
            d[k] = v
    except (IndexError, TypeError):
        pass
    del memo[mark:]
    return None


def _text_int(raw: bytes) -> Any:
    text = raw.strip()
    if text == b"00":
        return False
    if text == b"01":
        return True
    return int(text.rstrip(b"L"))


def _run(src: _Source) -> Any:
    buf = src.initial()
    pos = 0
    refill_at = _refill_at(buf, src)
    stack: list[Any] = []
    marks: list[int] = []
    memo: list[Any] = []
    shared = _RefLists(memo, max(src.size, 256))
    strings: dict[bytes, str] = {}
    push = stack.append
    memo_append = memo.append
    marks_append = marks.append
    ref_list = shared.at
    from_bytes = int.from_bytes
    if not buf:
        raise PickleFormatError("the file is empty")
    while True:
        if pos >= refill_at:
            buf, pos = src.more(buf, pos), 0
            refill_at = _refill_at(buf, src)
        op = buf[pos]
        pos += 1
        if op == 0x68:  # BINGET
            value = memo[buf[pos]]
            if value is _UNSET:
                raise IndexError(pos)
            push(value)
            pos += 1
        elif op == 0x6A:  # LONG_BINGET
            value = memo[from_bytes(buf[pos : pos + 4], "little")]
            if value is _UNSET:
                raise IndexError(pos)
            push(value)
            pos += 4
        elif op == 0x94:  # MEMOIZE
            memo_append(stack[-1])
        elif op == 0x71:  # BINPUT; the next slot (as picklers number them, torch's included) appended
            if buf[pos] == len(memo):
                memo_append(stack[-1])
            else:
                _memo_put(memo, buf[pos], stack[-1], shared)
            pos += 1
        elif op == 0x72:  # LONG_BINPUT
            idx = from_bytes(buf[pos : pos + 4], "little")
            if idx == len(memo):
                memo_append(stack[-1])
            else:
                _memo_put(memo, idx, stack[-1], shared)
            pos += 4
        elif op == 0x28:  # MARK
            marks_append(len(stack))
        elif op == 0x7D:  # EMPTY_DICT, with the flat-dict fast path
            if pos < refill_at and buf[pos] == 0x94 and buf[pos + 1] == 0x28:
                flat = _flat_dict(buf, pos - 1, memo, shared, strings, len(buf) if src.eof else refill_at)
                if flat is not None:
                    push(flat[0])
                    pos = flat[1]
                    continue
            push({})
        elif op == 0x75:  # SETITEMS
            k = marks.pop()
            items = stack[k:]
            del stack[k:]
            target = stack[-1]
            if type(target) is not dict or len(items) % 2:
                raise PickleFormatError(
                    "the pickle is corrupt (SETITEMS on something that is not a dict, or with an odd number of items)"
                )
            it = iter(items)
            target.update(zip(it, it, strict=False))
        elif op == 0x8A:  # LONG1
            n = buf[pos]
            push(from_bytes(buf[pos + 1 : pos + 1 + n], "little", signed=True))
            pos += 1 + n
        elif op == 0x4B:  # BININT1
            push(buf[pos])
            pos += 1
        elif op == 0x4D:  # BININT2
            push(buf[pos] | buf[pos + 1] << 8)
            pos += 2
        elif op == 0x4A:  # BININT
            push(from_bytes(buf[pos : pos + 4], "little", signed=True))
            pos += 4
        elif op == 0x5D:  # EMPTY_LIST, with the shared-reference-list fast path
            found = ref_list(buf, pos - 1) if pos < refill_at else None
            if found is None:
                push([])
                continue
            value, end = found
            put = buf[pos]
            if put == 0x94:
                memo_append(value)
            elif put == 0x71:
                _memo_put(memo, buf[pos + 1], value, shared)
            else:
                _memo_put(memo, from_bytes(buf[pos + 1 : pos + 5], "little"), value, shared)
            push(value)
            pos = end
        elif op == 0x8C:  # SHORT_BINUNICODE
            n = buf[pos]
            raw = buf[pos + 1 : pos + 1 + n]
            if len(raw) < n:
                raise IndexError(pos)
            s = strings.get(raw)
            if s is None:
                s = raw.decode("utf-8", "surrogatepass")
                if n <= _SHORT_STR and len(strings) < _STR_CACHE_MAX:
                    strings[raw] = s
            push(s)
            pos += 1 + n
        elif op == 0x58:  # BINUNICODE (torch's strings), sliced from the buffer when it holds it all
            n = from_bytes(buf[pos : pos + 4], "little")
            if pos + 4 + n <= len(buf):
                raw = buf[pos + 4 : pos + 4 + n]
                pos += 4 + n
            else:
                raw, buf, pos = src.take(buf, pos + 4, n)
                refill_at = _refill_at(buf, src)
            push(raw.decode("utf-8", "surrogatepass"))
        elif op == 0x65:  # APPENDS
            items = _pop_mark(stack, marks)
            target = stack[-1]
            if type(target) is not list:
                raise PickleFormatError("the pickle is corrupt (APPENDS on something that is not a list)")
            target.extend(items)
        elif op == 0x61:  # APPEND
            value = stack.pop()
            target = stack[-1]
            if type(target) is not list:
                raise PickleFormatError("the pickle is corrupt (APPEND on something that is not a list)")
            target.append(value)
        elif op == 0x95:  # FRAME: a length hint only
            pos += 8
        elif op == 0x73:  # SETITEM
            value = stack.pop()
            key = stack.pop()
            target = stack[-1]
            if type(target) is not dict:
                raise PickleFormatError("the pickle is corrupt (SETITEM on something that is not a dict)")
            target[key] = value
        elif op == 0x4E:  # NONE
            push(None)
        elif op == 0x88:  # NEWTRUE
            push(True)
        elif op == 0x89:  # NEWFALSE
            push(False)
        elif op == 0x85:  # TUPLE1
            stack[-1] = (stack[-1],)
        elif op == 0x86:  # TUPLE2
            b = stack.pop()
            stack[-1] = (stack[-1], b)
        elif op == 0x87:  # TUPLE3
            c = stack.pop()
            b = stack.pop()
            stack[-1] = (stack[-1], b, c)
        elif op == 0x29:  # EMPTY_TUPLE
            push(())
        elif op == 0x74:  # TUPLE
            push(tuple(_pop_mark(stack, marks)))
        elif op == 0x47:  # BINFLOAT
            push(struct.unpack(">d", buf[pos : pos + 8])[0])
            pos += 8
        elif op == 0x8D:  # BINUNICODE8
            raw, buf, pos = src.take(buf, pos + 8, from_bytes(buf[pos : pos + 8], "little"))
            push(raw.decode("utf-8", "surrogatepass"))
            refill_at = _refill_at(buf, src)
        elif op == 0x43:  # SHORT_BINBYTES
            raw, buf, pos = src.take(buf, pos + 1, buf[pos])
            push(raw)
            refill_at = _refill_at(buf, src)
        elif op == 0x42:  # BINBYTES
            raw, buf, pos = src.take(buf, pos + 4, from_bytes(buf[pos : pos + 4], "little"))
            push(raw)
            refill_at = _refill_at(buf, src)
        elif op == 0x8E:  # BINBYTES8
            raw, buf, pos = src.take(buf, pos + 8, from_bytes(buf[pos : pos + 8], "little"))
            push(raw)
            refill_at = _refill_at(buf, src)
        elif op == 0x96:  # BYTEARRAY8
            raw, buf, pos = src.take(buf, pos + 8, from_bytes(buf[pos : pos + 8], "little"))
            push(bytearray(raw))
            refill_at = _refill_at(buf, src)
        elif op == 0x8B:  # LONG4
            n = from_bytes(buf[pos : pos + 4], "little", signed=True)
            if n < 0:
                raise PickleFormatError("the pickle is corrupt (negative LONG4 length)")
            raw, buf, pos = src.take(buf, pos + 4, n)
            push(from_bytes(raw, "little", signed=True))
            refill_at = _refill_at(buf, src)
        elif op == 0x8F:  # EMPTY_SET
            push(set())
        elif op == 0x90:  # ADDITEMS
            items = _pop_mark(stack, marks)
            target = stack[-1]
            if type(target) is not set:
                raise PickleFormatError("the pickle is corrupt (ADDITEMS on something that is not a set)")
            target.update(items)
        elif op == 0x91:  # FROZENSET
            push(frozenset(_pop_mark(stack, marks)))
        elif op == 0x6C:  # LIST
            push(_pop_mark(stack, marks))
        elif op == 0x64:  # DICT
            items = _pop_mark(stack, marks)
            if len(items) % 2:
                raise PickleFormatError("the pickle is corrupt (DICT with an odd number of items)")
            push(dict(zip(items[::2], items[1::2], strict=True)))
        elif op == 0x30:  # POP
            if marks and marks[-1] == len(stack):
                marks.pop()
            else:
                stack.pop()
        elif op == 0x31:  # POP_MARK
            _pop_mark(stack, marks)
        elif op == 0x32:  # DUP
            push(stack[-1])
        elif op == 0x80:  # PROTO
            if buf[pos] > 5:
                raise PickleFormatError(f"unsupported pickle protocol {buf[pos]}")
            pos += 1
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or marks:
                raise PickleFormatError("the pickle is corrupt (STOP with an unbalanced stack)")
            return stack[0]
        elif op in (0x49, 0x4C, 0x46, 0x67, 0x70, 0x56, 0x53):  # text opcodes (protocol 0)
            raw, buf, pos = src.line(buf, pos)
            refill_at = _refill_at(buf, src)
            if op == 0x49:  # INT
                push(_text_int(raw))
            elif op == 0x4C:  # LONG
                push(int(raw.rstrip(b"L")))
            elif op == 0x46:  # FLOAT
                push(float(raw))
            elif op == 0x67:  # GET
                push(_memo_get(memo, int(raw)))
            elif op == 0x70:  # PUT
                _memo_put(memo, int(raw), stack[-1], shared)
            elif op == 0x56:  # UNICODE
                push(raw.decode("raw-unicode-escape"))
            else:  # STRING
                text = raw.strip()
                if len(text) < 2 or text[:1] != text[-1:] or text[:1] not in (b"'", b'"'):
                    raise PickleFormatError("the pickle is corrupt (a STRING is not quoted)")
                push(text[1:-1].decode("unicode_escape" if b"\\" in text else "latin-1"))
        elif op in (0x54, 0x55):  # BINSTRING, SHORT_BINSTRING (Python 2 str)
            n = from_bytes(buf[pos : pos + 4], "little", signed=True) if op == 0x54 else buf[pos]
            if n < 0:
                raise PickleFormatError("the pickle is corrupt (negative string length)")
            raw, buf, pos = src.take(buf, pos + (4 if op == 0x54 else 1), n)
            refill_at = _refill_at(buf, src)
            push(raw.decode("latin-1"))
        elif op == 0x63:  # GLOBAL: name what it asked for, import nothing
            module, buf, pos = src.line(buf, pos)
            attr, buf, pos = src.line(buf, pos)
            raise _unsafe(op, "import " + _printable(module) + "." + _printable(attr))
        elif op == 0x93:  # STACK_GLOBAL
            name = stack.pop() if stack else "?"
            owner = stack.pop() if stack else "?"
            raise _unsafe(op, "import " + _printable(str(owner)) + "." + _printable(str(name)))
        elif op in _UNSAFE_NAMES:
            raise _unsafe(op)
        else:
            raise PickleFormatError(
                f"not a pickle (unknown opcode 0x{op:02x} at byte {pos - 1} of the chunk)"
                if pos > 1 or stack
                else "not a pickle"
            )


def _printable(raw: bytes | str) -> str:
    """A name from the pickle, fit for a one-line message (control characters as '?')."""
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
    return "".join(c if c.isprintable() else "?" for c in text[:80])
