"""Opening files that may be hostile or broken: the analysis side's inputs, and what
``lorascope run`` and the probes write into a run directory someone else may have prepared
(docs/security.md).

- Confined: a file read from or written into a run directory stays in it. A read given
  ``inside`` resolves the path, refuses one that leaves the directory, then opens the
  resolved path one component at a time relative to a directory descriptor with
  ``O_NOFOLLOW``, so a symlink swapped in after the check is refused, not followed.
  Writes (:func:`create`, :func:`make_dirs`) never follow a symlink either.
- Only regular files are read: a FIFO, a device or a socket is refused with one line.
  The file is opened with ``O_NONBLOCK`` and checked with ``fstat`` on the open
  descriptor, so a FIFO never blocks and nothing can be swapped in between a check and
  the open.
- Reads are bounded: :func:`read_capped` stops at a limit (decompressed bytes for gzip,
  multi-member gzip included) and says which limit and which flag raises it.
- JSON nesting: :func:`json_depth` measures it without recursion, for inputs kept and
  walked later (run-directory records); whole-file JSON is bounded by the parser's own
  recursion guard (a RecursionError here becomes a one-line error).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import tempfile
import zlib
from pathlib import Path
from typing import IO, Any, BinaryIO

from lorascope.errors import BadInputError
from lorascope.rundir.format import limits
from lorascope.rundir.format.limits import LimitError

GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 20

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def not_regular(mode: int) -> str | None:
    """What a non-regular file is, in words ("a FIFO"); None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def refuse(path: Path | str, what: str) -> BadInputError:
    return BadInputError(f"{path}: {what}, not a regular file: refused (only regular files are read)")


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | _CLOEXEC


def _beneath(root: Path | str, path: Path | str) -> tuple[str, list[str]]:
    """ROOT resolved, and PATH's resolved components below it; BadInputError when PATH
    resolves outside ROOT (a symlink leaving it, a loop)."""
    try:
        real_root = os.path.realpath(root, strict=True)
        real = os.path.realpath(path, strict=True)
    except (OSError, RuntimeError) as exc:
        raise BadInputError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    rel = os.path.relpath(real, real_root)
    if rel == os.curdir or rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        raise BadInputError(f"{path}: a symlink out of the run directory: not followed")
    return real_root, rel.split(os.sep)


def _open_beneath(root: str, parts: list[str], flags: int) -> int:
    """Open ROOT/PARTS one component at a time, each with O_NOFOLLOW: a component that is
    a symlink (swapped in after PARTS were resolved) fails with ELOOP or ENOTDIR."""
    fd = os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    try:
        for part in parts[:-1]:
            below = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = below
        return os.open(parts[-1], flags | _NOFOLLOW, dir_fd=fd)
    finally:
        os.close(fd)


def _open_child(root: Path | str, path: Path | str) -> int | None:
    """PATH opened for reading when it is a file right in ROOT and no symlink (it is then
    where ROOT is: nothing to resolve, ~0.1 ms saved a file, thousands of files a run);
    None when it is not (the caller resolves it)."""
    name = os.path.basename(path)
    if name in ("", os.curdir, os.pardir) or os.path.dirname(path) != os.fspath(root):
        return None
    fd = os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    try:
        return os.open(name, _READ | _NOFOLLOW, dir_fd=fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink: it may still point inside ROOT
            return None
        raise
    finally:
        os.close(fd)


def open_regular(path: Path | str, inside: Path | str | None = None) -> BinaryIO:
    """Open PATH for binary reading if it is a regular file (after symlinks); else
    BadInputError. With INSIDE (a run directory), PATH must resolve inside it, and no
    symlink is followed after that check (see the module doc)."""
    try:
        if inside is None:
            fd = os.open(path, _READ)
        else:
            child = _open_child(inside, path)
            fd = child if child is not None else _open_beneath(*_beneath(inside, path), _READ)
    except OSError as exc:
        raise BadInputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        what = not_regular(os.fstat(fd).st_mode)
        if what is not None:
            raise refuse(path, what)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: Path | str) -> None:
    """BadInputError unless PATH is a regular file (stat only: nothing is opened)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise BadInputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    what = not_regular(mode)
    if what is not None:
        raise refuse(path, what)


def is_gzip(head: bytes) -> bool:
    return head[:2] == GZIP_MAGIC


def read_capped(path: Path | str, limit_name: str, what: str, inside: Path | str | None = None) -> bytearray:
    """The whole content of PATH (gunzipped when gzip), or LimitError past the limit
    ``limit_name`` (a field of :class:`~lorascope.rundir.format.limits.Limits`) in force.

    Truncated or corrupt gzip is a BadInputError. At most the limit + 1 MiB is held (a
    bytearray, not copied into bytes: json.loads takes it as it is)."""
    return _read(path, limit_name, what, keep_cut=False, inside=inside)[0]


def read_capped_cut(
    path: Path | str, limit_name: str, what: str, inside: Path | str | None = None
) -> tuple[bytearray, bool]:
    """As :func:`read_capped`, but a gzip file that ends inside its compressed stream (a
    writer killed mid-file) gives what it holds, and True: for readers that can use the
    start of a file cut short."""
    return _read(path, limit_name, what, keep_cut=True, inside=inside)


def _read(
    path: Path | str, limit_name: str, what: str, keep_cut: bool, inside: Path | str | None = None
) -> tuple[bytearray, bool]:
    limit = getattr(limits.current(), limit_name)
    with open_regular(path, inside) as f:
        head = f.read(2)
        out = bytearray(head)
        if is_gzip(head):
            out.clear()
            return out, _inflate(f, head, out, limit, path, limit_name, what, keep_cut)
        while chunk := f.read(_CHUNK):
            out += chunk
            if len(out) > limit:
                raise LimitError(str(path), what, limit_name)
    return out, False


def _inflate(
    f: IO[bytes], head: bytes, out: bytearray, limit: int, path: Path | str, name: str, what: str, keep_cut: bool
) -> bool:
    """Gunzip f (every member, as gzip does) into out, never past limit + one chunk; True
    when it ends inside a compressed stream and ``keep_cut`` (else that is a BadInputError)."""
    d = zlib.decompressobj(zlib.MAX_WBITS | 16)
    fed = False
    data = head
    try:
        while True:
            if not data:
                data = f.read(_CHUNK)
                if not data:
                    if fed:  # output zlib still holds (it stopped at max_length as the input ran out)
                        out += d.flush()
                        if len(out) > limit:
                            raise LimitError(str(path), what, name)
                    break
            if not fed:  # a new member; zero bytes between members are padding
                data = data.lstrip(b"\x00")
                if not data:
                    continue
            fed = True
            out += d.decompress(data, _CHUNK)
            if len(out) > limit:
                raise LimitError(str(path), what, name)
            data = d.unused_data if d.eof else d.unconsumed_tail
            if d.eof:
                d, fed = zlib.decompressobj(zlib.MAX_WBITS | 16), False
    except zlib.error as exc:
        raise BadInputError(f"{path}: not a readable gzip file ({exc})") from None
    if fed and not d.eof:
        if keep_cut:
            return True
        raise BadInputError(f"{path}: a truncated gzip file (it ends inside the compressed stream)")
    return False


def loads_json(data: bytes | bytearray, path: Path | str, what: str) -> Any:
    """Parse JSON text; BadInputError (one line) when it is not JSON or is nested too deep."""
    try:
        return json.loads(data)
    except RecursionError:
        raise BadInputError(f"{path}: {what} nested deeper than the JSON reader goes (~1000 levels)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadInputError(f"{path}: {what} is not valid JSON ({str(exc)[:100]})") from None


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(text: bytes) -> int:
    """How deep JSON TEXT nests (strings ignored), without recursion."""
    depth = deepest = 0
    for c in _STRINGS.sub(b"", text).translate(None, _NOT_BRACKETS):
        if c in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def maybe_too_deep(line: bytes, max_depth: int) -> bool:
    """Whether LINE nests deeper than max_depth (cheap: only lines with that many brackets
    are scanned)."""
    return line.count(b"[") + line.count(b"{") > max_depth and json_depth(line) > max_depth


def leaves(root: Path, path: Path) -> bool:
    """Whether PATH (a symlink, or under one) resolves outside ROOT."""
    if path.parent == root and path.name != os.pardir and not path.is_symlink():  # right in ROOT
        return False
    try:
        return not path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a symlink loop
        return True


def read_head(path: Path | str, most: int, inside: Path | str | None = None) -> bytes:
    """At most MOST bytes from the start of the regular file PATH (no gunzipping)."""
    with open_regular(path, inside) as f:
        return f.read(most)


def make_dirs(root: Path, path: Path, mode: int = 0o755) -> None:
    """Create PATH and the folders between ROOT and it, none of which may be a symlink
    or anything but a folder (OSError): a run directory's ``ranks/rank-0`` planted as a
    symlink to elsewhere is refused, not written through."""
    root.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(path, root)
    if rel == os.curdir:
        return
    if rel.startswith(os.pardir) or os.path.isabs(rel):
        raise OSError(errno.EXDEV, "not inside the run directory", str(path))
    fd = os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    try:
        for part in rel.split(os.sep):
            try:
                os.mkdir(part, mode, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                below = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd)
            except OSError as exc:
                raise OSError(exc.errno, f"not a folder (a symlink?): {exc.strerror}", str(path)) from None
            os.close(fd)
            fd = below
    finally:
        os.close(fd)


def create(
    path: Path | str, append: bool = False, exclusive: bool = False, mode: int = 0o644, readable: bool = False
) -> int:
    """A descriptor for writing PATH (created if missing; truncated unless APPEND; also
    for reading if READABLE: a shared mapping needs both), never through a symlink
    (ELOOP), only into a regular file: a FIFO, a device or a folder planted at PATH is an
    OSError."""
    flags = (os.O_RDWR if readable else os.O_WRONLY) | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY | _NOFOLLOW | _CLOEXEC
    flags |= os.O_APPEND if append else 0
    flags |= os.O_EXCL if exclusive else 0
    fd = os.open(path, flags, mode)
    try:
        what = not_regular(os.fstat(fd).st_mode)
        if what is not None:
            raise OSError(errno.EINVAL, f"{what}, not a regular file", str(path))
        if not append and not exclusive:
            os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def untrusted_dir(path: Path | str) -> str | None:
    """Why a folder that exists is not to be trusted with code that runs in a job (owned
    by another user, or writable by its group or by anyone: OpenSSH's StrictModes, git's
    safe.directory); None for one of this user's own, or none at all."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be checked ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "not a folder"
    if st.st_uid != os.geteuid():
        return f"owned by {_user(st.st_uid)}, not by you"
    if st.st_mode & 0o022:
        who = "anyone" if st.st_mode & 0o002 else "its group"
        return f"writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def replace_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write DATA as PATH through a new file in its folder renamed over it: whatever was
    at PATH (a symlink, a FIFO) is replaced, not written through or waited on."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
