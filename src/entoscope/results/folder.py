"""Run folders: checked before any work, written beside and renamed into place.

A run folder (one with a manifest.json) is never replaced unless the caller asks (`overwrite`),
and never holds files of two runs: `writing_run(folder)` yields a fresh hidden sibling folder,
and only when everything is written is it renamed to `folder` (an older run there is moved
aside first and deleted after). An error or Ctrl-C while writing removes the partial folder
and leaves what was there untouched. Concurrent writers of sibling folders never share a file.

Each writer holds a lock on its partial folder (flock, released by the kernel when the process ends,
however it ends), so a partial folder of the same destination that nobody holds is a leftover of a
writer that was killed: the next writer of that destination removes it, or, where the caller can go
on with it (`reuse`: an interrupted report, report/resume.py), takes it over. A caller may also keep
its partial folder when interrupted (`keep`: what it holds can be reused by the next writer).

The same rules hold for every command that writes a folder (`Output`: a run, a dictionary from
`train-sae`, a tuned lens from `train-lens`): the folder is checked before any work and replaced only
with `--overwrite`, and never when it holds something else.

A sharded run (docs/scale.md) writes its finished shards into `folder/shards/` while it runs: a folder
holding only that is an unfinished run, which `--resume` continues and whose shards the saved run keeps.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import SaveError

_KEEP = "nothing was saved; what was at the destination is untouched"


def check_writable(folder: str | Path) -> Path:
    """Refuse a folder that cannot be created or written: a file there or above it, no permission."""
    target = Path(folder).expanduser()
    for parent in [target, *target.parents]:
        if parent.exists() and not parent.is_dir():
            if parent == target:
                raise SaveError(f"the output folder {target} is a file", code="out_is_a_file",
                                remedy="choose an output folder that is not a file")
            raise SaveError(f"the output folder {target} is under {parent}, which is a file", code="out_under_a_file",
                            remedy="choose an output folder that is not under a file")
        if parent.exists():
            if not os.access(parent, os.W_OK | os.X_OK):
                raise SaveError(f"cannot write into {parent} (permission denied)", code="out_not_writable",
                                remedy="choose a folder you can write to")
            break
    return target


SHARDS = "shards"


@dataclass(frozen=True)
class Output:
    """What a command writes into its output folder, and the files that show a folder already holds one."""

    what: str  # "run", "dictionary", "tuned lens"
    markers: tuple[str, ...]
    exists_code: str

    def holds(self, folder: Path) -> bool:
        return all((folder / m).is_file() for m in self.markers)


RUN = Output("run", ("manifest.json",), "run_exists")
DICTIONARY = Output("dictionary", ("cfg.json", "sae_weights.safetensors"), "dictionary_exists")
TUNED_LENS = Output("tuned lens", ("config.json", "translators.safetensors"), "lens_exists")
JACOBIAN_LENS = Output("Jacobian lens", ("lens.pt",), "lens_exists")


def is_unfinished(folder: str | Path) -> bool:
    """Whether `folder` holds only the shards of a sharded run that has not been saved yet (its store.json,
    or shard files whose store.json was lost: each shard names its run, so --resume can rebuild it)."""
    target = Path(folder)
    shards = target / SHARDS
    return target.is_dir() and [p.name for p in target.iterdir()] == [SHARDS] and shards.is_dir() and \
        ((shards / "store.json").exists() or any(shards.glob("*.parquet")))


def check_out(folder: str | Path, *, overwrite: bool = False, resume: bool = False, output: Output = RUN) -> Path:
    """Refuse, before any work, a destination that cannot take the output (a run folder by default; a
    dictionary or tuned-lens folder for train-sae / train-lens): a file, a folder of something else, or
    one already holding such an output without `overwrite`.

    An unfinished sharded run there is refused unless the run resumes it (or overwrites it)."""
    target = check_writable(folder)
    if target.is_dir() and any(target.iterdir()):
        if output is RUN and is_unfinished(target):
            if not (resume or overwrite):
                raise SaveError(f"{target} holds the shards of an unfinished run", code="run_unfinished",
                                remedy="pass --resume to finish it, or --overwrite to start again")
            return target
        if not output.holds(target):
            raise SaveError(f"{target} exists and is not an entoscope {output.what} folder (no "
                            f"{' and '.join(output.markers)}); refusing to replace its files", code="out_not_empty",
                            remedy=f"choose a new or empty folder for the {output.what}")
        if not overwrite:
            raise SaveError(f"{target} already holds a {output.what}", code=output.exists_code,
                            remedy="pass --overwrite (Python: overwrite=True) to replace it, or choose another folder")
    return target


@contextlib.contextmanager
def writing_run(folder: str | Path, *, overwrite: bool = False, keep_shards: bool = False,
                output: Output = RUN, reuse: Callable[[Path], bool] | None = None,
                keep: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Yield a fresh folder to write a run (or another `output`) into; on success it becomes `folder`,
    atomically per folder.

    keep_shards: the `shards/` folder already at the destination (this run's) moves into the new run folder.
    reuse: called on each leftover partial folder of this destination that no writer holds (newest first);
    the first for which it returns True is yielded instead of a fresh one, the others are removed. It may
    raise (nothing is removed then).
    keep: called on the partial folder when the writing stops with an error or Ctrl-C; True keeps it (for
    the next writer's `reuse`), else it is removed."""
    target = check_out(folder, overwrite=overwrite, resume=keep_shards, output=output)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial, lock = _take_leftover(target, reuse) if reuse is not None else (None, None)
        if partial is None:
            partial, lock = _fresh_partial(target)
    except SaveError:  # `reuse` refused a leftover
        raise
    except OSError as err:
        raise SaveError(f"cannot create the output folder {target} ({err.strerror or err})",
                        remedy="check the path, the free space and the permissions") from None
    try:
        _remove_leftovers(target, keep=partial)
        yield partial
        if keep_shards and (target / SHARDS).is_dir():
            os.rename(target / SHARDS, partial / SHARDS)
        _swap_in(partial, target, overwrite or keep_shards, output)
    except OSError as err:
        _give_back_shards(partial, target)
        _drop(partial, keep)
        if isinstance(err, SaveError):
            raise
        raise SaveError(f"writing {target} failed ({err.strerror or err}); {_KEEP}",
                        remedy="free some disk space or choose another folder, then run again") from None
    except BaseException:
        _give_back_shards(partial, target)
        _drop(partial, keep)
        raise
    finally:
        _unlock(lock)


PARTIAL = "partial-"


def _fresh_partial(target: Path) -> tuple[Path, int | None]:
    """A new partial folder, locked before it takes a name that writers of the same destination look at
    (so none of them can take a writer's brand-new folder for a leftover)."""
    made = Path(tempfile.mkdtemp(prefix=f".{target.name}.creating-", dir=target.parent))
    lock = _lock(made)
    partial = made.with_name(f".{target.name}.{PARTIAL}{made.name.rsplit('-', 1)[1]}")
    os.rename(made, partial)
    return partial, lock


def leftovers(target: Path) -> list[Path]:
    """The partial folders of `target`'s writers, newest first (held or not)."""
    found = [p for p in target.parent.glob(f".{target.name}.{PARTIAL}*") if p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def _take_leftover(target: Path, reuse: Callable[[Path], bool]) -> tuple[Path | None, int | None]:
    """The newest leftover partial folder nobody holds that `reuse` accepts, locked; (None, None) if none."""
    for old in leftovers(target):
        lock = _lock(old, wait=False)
        if lock is None or lock == -1:
            continue  # a live writer's (or no locks here: never taken)
        try:
            if reuse(old):
                return old, lock
        except BaseException:
            _unlock(lock)
            raise
        _unlock(lock)
    return None, None


def _remove_leftovers(target: Path, keep: Path) -> None:
    """Remove the partial folders of `target` that no live writer holds (left by a killed one), but `keep`."""
    for old in leftovers(target):
        if old == keep:
            continue
        lock = _lock(old, wait=False)
        if lock is None or lock == -1:
            continue  # a live writer's (or no locks here: never removed)
        try:
            shutil.rmtree(old, ignore_errors=True)
        finally:
            _unlock(lock)


def _drop(partial: Path, keep: Callable[[Path], bool] | None) -> None:
    try:
        kept = keep is not None and keep(partial)
    except Exception:  # noqa: BLE001 - deciding what to keep must not hide the error being raised
        kept = False
    if not kept:
        shutil.rmtree(partial, ignore_errors=True)


def _lock(folder: Path, wait: bool = True) -> int | None:
    """An exclusive lock on `folder` (flock on the folder itself): its descriptor, -1 where another writer
    holds it (wait False), None where locks are not available (then leftovers are never taken or removed)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return None
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return -1
    except OSError:
        os.close(fd)
        return None
    return fd


def _unlock(fd: int | None) -> None:
    if fd is not None and fd >= 0:
        os.close(fd)


def _give_back_shards(partial: Path, target: Path) -> None:
    """A failed save leaves the run's shards where they were (so --resume still finds them)."""
    if (partial / SHARDS).is_dir() and not (target / SHARDS).exists():
        target.mkdir(parents=True, exist_ok=True)
        os.rename(partial / SHARDS, target / SHARDS)


def _swap_in(partial: Path, target: Path, overwrite: bool, output: Output = RUN) -> None:
    os.chmod(partial, 0o755)  # mkdtemp makes it private
    if target.exists():
        check_out(target, overwrite=overwrite, output=output)  # another writer may have put one there meanwhile
        if any(target.iterdir()):
            aside = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(target, aside)
            try:
                os.rename(partial, target)
            except OSError:
                os.rename(aside, target)
                raise
            shutil.rmtree(aside, ignore_errors=True)
            return
        target.rmdir()
    try:
        os.rename(partial, target)
    except OSError as err:  # another writer created it between our check and the rename
        raise SaveError(f"{target} appeared while this run was being written (another process?); {_KEEP}",
                        code="run_exists", remedy="write concurrent runs into different folders") from err
