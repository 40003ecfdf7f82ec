"""The wheels SGLang needs on the device machine beyond its image, packed into parts one device call can carry.

The device machine reaches no package index, and a call carries at most 64 MiB with the working tree (~25 MiB),
so SGLang (the `sglang` extra's version) travels as wheels in parts of at most PART_MIB, a wheel larger than
that split across parts. This resolves the closure of SGLang's requirements for the device's Python (3.12,
x86-64 Linux) one wheel at a time (`pip download --no-deps`), skipping what the image holds
(device_image_packages.txt) unless pinned here, and what SGLang imports only for features the plugin does not
use (SKIP: other kernels' JIT stacks, multimodal decoders, hub clients), then writes the parts and a manifest:

    python benchmarks/sglang_wheels.py prepare --out .ferry/sglang     -> part01 .. partNN, manifest.json there
    python3 benchmarks/sglang_wheels.py join --manifest M --staged DIR --out WHEELS     (on the device)
    python3 benchmarks/sglang_wheels.py check       (on the device, installed: every launch-path module imports)

benchmarks/sglang_ferry.sh stages the parts on the device call by call, joins and installs them.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent
SGLANG = "sglang==0.5.17"
PART_MIB = 28  # a part beside the working tree (~32 MiB; `sglang_ferry.sh prepare` checks) within 64 MiB
# the device's interpreter and platform, as pip's --platform tags and as marker values
PLATFORMS = ["manylinux1_x86_64", "manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(5, 40)),
             "linux_x86_64"]
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
# carried although the image has a version: SGLang pins another (as sglang-cpu.txt does for the CPU tests)
PINNED = {"transformers": "5.12.1", "tokenizers": "0.22.2", "huggingface-hub": "1.33.0", "xgrammar": "0.2.1"}
# imported by SGLang only for what the plugin leaves off: other attention / GEMM kernel stacks, multimodal
# inputs, model hubs, other grammar backends, profilers. `check` (run by sglang_ferry.sh install) imports the
# launch path and names any module still missing.
SKIP = {"flash-attn-4", "tilelang", "helion", "humming-kernels", "tokenspeed-mla", "kernels", "nvidia-cutlass-dsl",
        "nvidia-mathdx", "quack-kernels", "sgl-deep-gemm", "modelscope", "torchcodec", "av", "decord2",
        "outlines", "llguidance", "mistral-common", "anthropic", "py-spy", "smg-grpc-servicer",
        "blobfile", "torch-memory-saver", "openai-harmony", "torchao", "timm", "torchaudio", "torchvision", "torch",
        "cuda-python"}
# imported at module level on SGLang's launch path though only skipped packages require them (the OpenAI chat
# entry point validates tool schemas with jsonschema)
IMPORTED = ("jsonschema",)
# the modules a server and its benchmark import: the HTTP entry point, the scheduler and its workers (SGLang's
# own speculative ones and the plugin's), the attention backends the benchmarks use, the model, bench_serving
LAUNCH_MODULES = ("sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
                  "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.detokenizer_manager",
                  "sglang.srt.model_executor.model_runner", "sglang.srt.speculative.ngram_worker",
                  "sglang.srt.speculative.dflash_worker_v2", "sglang.srt.layers.attention.triton_backend",
                  "sglang.srt.layers.attention.flashinfer_backend", "sglang.srt.models.llama", "sglang.bench_serving",
                  "specpilot.sglang_ext.plugin", "specpilot.sglang_ext.worker")


def image_packages() -> set[str]:
    lines = (ROOT / "device_image_packages.txt").read_text().splitlines()
    return {canonicalize_name(line) for line in lines if line and not line.startswith("#")}


def download(spec: str, into: Path) -> Path:
    before = set(into.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", "-d", str(into), spec]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd, check=True)
    new = set(into.iterdir()) - before
    if len(new) != 1:
        raise RuntimeError(f"pip download {spec}: expected one new wheel, got {sorted(p.name for p in new)}")
    return new.pop()


def requirements(wheel: Path, extras: set[str]) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(name).decode())
    reqs = []
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate(MARKERS | {"extra": e}) for e in extras | {""}):
            reqs.append(req)
    return reqs


def resolve(into: Path) -> dict[str, Path]:
    """name -> wheel, for SGLang and the requirements the image does not meet."""
    image, carried = image_packages(), {}
    queue = [Requirement(SGLANG), *map(Requirement, IMPORTED)]
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in carried or name in SKIP or (name in image and name not in PINNED):
            continue
        spec = f"{name}=={PINNED[name]}" if name in PINNED else f"{name}{req.specifier}"
        wheel = download(spec, into)
        carried[name] = wheel
        print(f"{wheel.stat().st_size / 2**20:8.1f} MiB  {wheel.name}", flush=True)
        queue += requirements(wheel, set(req.extras))
    return carried


def pack(wheels: dict[str, Path], out: Path, part_bytes: int = PART_MIB * 2**20) -> dict:
    """Wheels (split where larger than a part) into parts of at most `part_bytes`, largest pieces first."""
    limit = part_bytes
    pieces: list[tuple[str, bytes]] = []  # (piece file name, bytes)
    manifest: dict = {"sglang": SGLANG, "part_bytes": part_bytes, "wheels": []}
    for wheel in sorted(wheels.values(), key=lambda p: p.name):
        data = wheel.read_bytes()
        chunks = [data[o : o + limit] for o in range(0, len(data), limit)]
        names = [wheel.name if len(chunks) == 1 else f"{wheel.name}.{k:02d}" for k in range(len(chunks))]
        manifest["wheels"].append({"file": wheel.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                                   "pieces": names})
        pieces += list(zip(names, chunks))
    parts: list[list[tuple[str, bytes]]] = []
    sizes: list[int] = []
    for name, data in sorted(pieces, key=lambda p: -len(p[1])):
        slot = next((k for k, s in enumerate(sizes) if s + len(data) <= limit), None)
        if slot is None:
            parts.append([])
            sizes.append(0)
            slot = len(parts) - 1
        parts[slot].append((name, data))
        sizes[slot] += len(data)
    for k, files in enumerate(parts, start=1):
        part = out / f"part{k:02d}"
        part.mkdir(parents=True)
        for name, data in files:
            (part / name).write_bytes(data)
    manifest["parts"] = len(parts)
    return manifest


def join(manifest: dict, staged: Path, out: Path) -> list[Path]:
    """On the device: every wheel of the manifest from its staged pieces, each checked against its sha256."""
    missing = [p for w in manifest["wheels"] for p in w["pieces"] if not (staged / p).is_file()]
    if missing:
        raise SystemExit(f"not staged yet: {missing} (stage every part first)")
    out.mkdir(parents=True, exist_ok=True)
    wheels = []
    for w in manifest["wheels"]:
        data = b"".join((staged / p).read_bytes() for p in w["pieces"])
        if hashlib.sha256(data).hexdigest() != w["sha256"]:
            raise SystemExit(f"{w['file']}: its sha256 differs from the manifest's")
        wheels.append(out / w["file"])
        wheels[-1].write_bytes(data)
    return wheels


def missing_imports(modules: tuple[str, ...]) -> dict[str, str]:
    """module -> the module its import found missing, for each of `modules` whose import fails that way (other
    failures, such as a kernel library without a GPU, are not a missing package and are left to the launch)."""
    missing = {}
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            missing[module] = err.name or str(err)
    return missing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    prepare = sub.add_parser("prepare", help="here: resolve, download and pack the wheels")
    prepare.add_argument("--out", type=Path, default=Path(".ferry/sglang"))
    joining = sub.add_parser("join", help="on the device: the staged pieces back into checked wheels")
    joining.add_argument("--manifest", type=Path, required=True)
    joining.add_argument("--staged", type=Path, required=True)
    joining.add_argument("--out", type=Path, required=True)
    sub.add_parser("check", help="on the device, after installing: import SGLang's launch path, name what is missing")
    args = ap.parse_args()
    if args.command == "check":
        missing = missing_imports(LAUNCH_MODULES)
        for module, name in missing.items():
            print(f"{module}: no module named {name!r}")
        if missing:
            raise SystemExit(f"{len(set(missing.values()))} package(s) missing: carry them (IMPORTED, or out of SKIP)")
        print(f"SGLang's launch path imports ({len(LAUNCH_MODULES)} modules)")
        return
    if args.command == "join":
        wheels = join(json.loads(args.manifest.read_text()), args.staged, args.out)
        print(f"{len(wheels)} wheels joined and checked -> {args.out}")
        return
    if args.out.exists():
        raise SystemExit(f"{args.out} exists: remove it first")
    with tempfile.TemporaryDirectory() as tmp:
        wheels = resolve(Path(tmp))
        manifest = pack(wheels, args.out)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    total = sum(w["size"] for w in manifest["wheels"])
    print(f"{len(manifest['wheels'])} wheels, {total / 2**20:.0f} MiB in {manifest['parts']} parts -> {args.out}")


if __name__ == "__main__":
    main()
