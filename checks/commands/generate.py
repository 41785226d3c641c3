"""``decodespec generate``: greedy generation with our decoder on SmolLM2 or the tiny model.

Plain mode prints the generated text; ``--json`` prints one JSON object with ``prompt_ids``,
``output_ids``, ``text``, ``logprobs``, ``finish_reason``, ``triggers``, ``frontier`` and the
run's ``model``, ``device``, ``dtype``, ``attention`` and ``seed``.  ``--chat`` wraps the
prompt as one user message in the model's chat template.  ``--seed`` is recorded (greedy draws
nothing; sampling arrives with the policy work).

Exit codes: 0 success, 2 invalid input (typed ``Rejection``/``ResourceLimit``, printed as JSON
on stderr), 3 the model file is not installed.

Source: docs/design.md section 8 (runtime outputs); M3.10 0x03 "Decoder-only serving loop".
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand."""
    parser = subparsers.add_parser(
        "generate",
        help="greedy generation with the reference decoder (SmolLM2 or the tiny model)",
        description="Greedy generation: prefill the prompt, decode one token per call over a dynamic cache, "
        "stop on EOS or --max-new-tokens.",
    )
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2", help="model to run (default smollm2)")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user message")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="G, the most tokens to generate (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="request seed (recorded; greedy draws nothing)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa", help="attention implementation (default sdpa)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run one greedy request and print the result; returns the exit code."""
    from decodespec.impl.device import resolve_device, resolve_dtype
    from decodespec.impl.gguf import MODEL_FILE_MISSING
    from decodespec.impl.generate import greedy_generate
    from decodespec.spec.errors import DecodeSpecError

    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype)
        model, tokenizer = _load(args.model, dtype, device, args.attention)
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        prompt_ids = tokenizer.encode(text)
        if tokenizer.add_bos_token and tokenizer.bos_token_id is not None:
            prompt_ids = [tokenizer.bos_token_id, *prompt_ids]
        result = greedy_generate(model, prompt_ids, max_new_tokens=args.max_new_tokens, tokenizer=tokenizer)
    except DecodeSpecError as exc:
        print(json.dumps({"error": exc.to_json()}), file=sys.stderr)
        return 3 if exc.code == MODEL_FILE_MISSING else 2
    if args.json:
        payload = result.to_json()
        payload.update(model=args.model, device=str(device), dtype=args.dtype, attention=args.attention, seed=args.seed)
        print(json.dumps(payload, ensure_ascii=False))
    else:
        print(result.text)
    return 0


def _load(name: str, dtype, device, attention: str):
    if name == "tiny":
        from decodespec.impl.tiny import TINY_VOCAB_SIZE, load_tiny
        from decodespec.impl.tokenizer import ByteTokenizer

        return load_tiny(dtype=dtype, device=device, attn_implementation=attention), ByteTokenizer(TINY_VOCAB_SIZE)
    from decodespec.impl.tokenizer import load_smollm2_tokenizer
    from decodespec.impl.weights import load_smollm2

    return load_smollm2(dtype=dtype, device=device, attn_implementation=attention), load_smollm2_tokenizer()
