"""``decodespec generate``: generation with our decoder on SmolLM2 or the tiny model.

Plain mode prints the generated text; ``--json`` prints one JSON object with ``prompt_ids``,
``output_ids``, ``text``, ``logprobs``, ``finish_reason``, ``triggers``, ``frontier``, one M3.8
decision ``receipts`` entry per output token, ``rng_counter`` (draws consumed), the ``policy``
and the run's ``model``, ``device``, ``dtype``, ``attention``, ``seed`` and ``identity``.
``--chat`` wraps the prompt as one user message in the model's chat template.

The decoding policy (M3.8) is built from the flags: greedy by default; ``--do-sample`` selects
the multinomial family with ``--temperature`` (0 = the greedy branch), ``--top-k``, ``--top-p``
and ``--min-p`` (sampling only); ``--repetition-penalty`` applies in both families;
``--order`` picks the transform order (``default`` or a peer's: ``hf``, ``vllm``,
``llama.cpp``).  Randomness is request-owned: the Philox key is derived from the request
identity (the content hash of model, prompt ids, policy and ``max_new_tokens``) and ``--seed``,
and each decision at step t draws the uniform at address ``(t, 0)``.

Exit codes: 0 success, 2 invalid input (typed ``Rejection``/``ResourceLimit``, printed as JSON
on stderr), 3 the model file is not installed.

Source: docs/design.md section 8 (runtime outputs); M3.10 0x03 "Decoder-only serving loop".
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["policy_json", "register", "run"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand."""
    parser = subparsers.add_parser(
        "generate",
        help="generation with the reference decoder (SmolLM2 or the tiny model), greedy or sampled",
        description="Generation: prefill the prompt, decode one token per call over a dynamic cache, decide each "
        "token with the M3.8 policy (greedy, or --do-sample), stop on EOS or --max-new-tokens.",
    )
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2", help="model to run (default smollm2)")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user message")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="G, the most tokens to generate (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="request seed; keys the RNG stream with the request identity (greedy draws nothing)")
    parser.add_argument("--do-sample", action="store_true", help="multinomial family (default: greedy)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature T >= 0 (0 = greedy branch)")
    parser.add_argument("--top-k", type=int, default=None, help="keep exactly the k highest scores (sampling)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus mass p in (0, 1] (sampling)")
    parser.add_argument("--min-p", type=float, default=None, help="keep p >= min_p * p_max (sampling)")
    parser.add_argument("--repetition-penalty", type=float, default=None, help="sign-aware repetition penalty r > 0 over prompt and output")
    parser.add_argument("--order", choices=("default", "hf", "vllm", "llama.cpp"), default="default", help="transform order preset (default: the normative order)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa", help="attention implementation (default sdpa)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run one greedy request and print the result; returns the exit code."""
    from decodespec.impl.device import resolve_device, resolve_dtype
    from decodespec.impl.gguf import MODEL_FILE_MISSING
    from decodespec.impl.generate import generate
    from decodespec.spec.errors import DecodeSpecError
    from decodespec.spec.policy import policy_config_from_json
    from decodespec.spec.policy.receipt import content_id

    try:
        policy = policy_config_from_json(policy_json(args))
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype)
        model, tokenizer = _load(args.model, dtype, device, args.attention)
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        prompt_ids = tokenizer.encode(text)
        if tokenizer.add_bos_token and tokenizer.bos_token_id is not None:
            prompt_ids = [tokenizer.bos_token_id, *prompt_ids]
        identity = content_id({"model": args.model, "prompt_ids": list(prompt_ids), "policy": policy.to_json(), "max_new_tokens": args.max_new_tokens})
        result = generate(model, prompt_ids, max_new_tokens=args.max_new_tokens, policy=policy, tokenizer=tokenizer,
                          identity=identity, seed=args.seed, vocab_hash=getattr(tokenizer, "sha256", ""))
    except DecodeSpecError as exc:
        print(json.dumps({"error": exc.to_json()}), file=sys.stderr)
        return 3 if exc.code == MODEL_FILE_MISSING else 2
    if args.json:
        payload = result.to_json()
        payload.update(model=args.model, device=str(device), dtype=args.dtype, attention=args.attention, seed=args.seed,
                       identity=identity, policy=policy.to_json())
        print(json.dumps(payload, ensure_ascii=False))
    else:
        print(result.text)
    return 0


def policy_json(args: argparse.Namespace) -> dict:
    """The M3.8 policy JSON object the sampling flags describe (validated by ``policy_config_from_json``).

    Warpers given without ``--do-sample`` are kept, so that the policy rejects them
    (``policy.warper_requires_sampling``) instead of silently ignoring them.
    """
    transforms = []
    if args.repetition_penalty is not None:
        transforms.append({"name": "repetition_penalty", "penalty": args.repetition_penalty})
    if args.temperature is not None:
        transforms.append({"name": "temperature", "temperature": args.temperature})
    if args.top_k is not None:
        transforms.append({"name": "top_k", "k": args.top_k})
    if args.top_p is not None:
        transforms.append({"name": "top_p", "p": args.top_p})
    if args.min_p is not None:
        transforms.append({"name": "min_p", "p": args.min_p})
    return {"family": "multinomial" if args.do_sample else "greedy", "order": args.order, "transforms": transforms}


def _load(name: str, dtype, device, attention: str):
    if name == "tiny":
        from decodespec.impl.tiny import TINY_VOCAB_SIZE, load_tiny
        from decodespec.impl.tokenizer import ByteTokenizer

        return load_tiny(dtype=dtype, device=device, attn_implementation=attention), ByteTokenizer(TINY_VOCAB_SIZE)
    from decodespec.impl.tokenizer import load_smollm2_tokenizer
    from decodespec.impl.weights import load_smollm2

    return load_smollm2(dtype=dtype, device=device, attn_implementation=attention), load_smollm2_tokenizer()
