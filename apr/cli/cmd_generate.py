"""`apr generate SOURCE --prompt TEXT`: continue prompts with a trained model (docs/generate.md)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import typer

from apr.errors import AprError, Finding
from apr.generate.prompts import read_prompts

MAX_SEED = 2**63 - 1  # a seed torch's generator takes and JSON readers hold exactly


def _check_numbers(*, max_new_tokens: int, temperature: float, top_p: float, repetition_penalty: float,
                   seed: int | None) -> None:
    """Numbers no generation can use (non-finite floats, a seed past 63 bits), refused by option name
    before the model loads; the ranges of each option are checked where the option is defined."""
    def bad(option: str, expected: str, got) -> AprError:
        return AprError(f"{option} must be {expected}, not {got}", [Finding(
            "error", "generate.option", f"{option} out of range", path=option, expected=expected, got=str(got))])

    for option, value in (("--temperature", temperature), ("--top-p", top_p),
                          ("--repetition-penalty", repetition_penalty)):
        if not math.isfinite(value):
            raise bad(option, "a finite number", value)
    if max_new_tokens < 1:
        raise bad("--max-new-tokens", ">= 1", max_new_tokens)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise bad("--seed", f"in [0, {MAX_SEED}]", seed)


def register(app: typer.Typer) -> None:
    @app.command("generate")
    def generate_cmd(
        source: Path = typer.Argument(..., show_default=False, help=(
            "checkpoint-*.json or .safetensors, a run directory (its latest good checkpoint), or a "
            "folder written by apr export.")),
        prompt: list[str] = typer.Option([], "--prompt", "-p", help=(
            "Text to continue; repeat for a batch; '-' reads all of stdin as one prompt.")),
        prompt_file: str | None = typer.Option(None, "--prompt-file", metavar="FILE", help=(
            "One prompt per line, all generated as one batch; '-' reads stdin.")),
        max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="Tokens to generate at most."),
        temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 is greedy; > 0 samples."),
        top_k: int = typer.Option(0, "--top-k", help="Sample from the k most likely tokens (0: all)."),
        top_p: float = typer.Option(1.0, "--top-p", help="Sample from the smallest set with this probability."),
        repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help="> 1 discourages repeats."),
        seed: int | None = typer.Option(None, "--seed", help="Seed of the sampler (default: random, printed)."),
        stop: list[str] = typer.Option([], "--stop", help="End the text before this string (repeatable)."),
        ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Go on past the end-of-text token."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON document instead of text."),
        logprobs: bool = typer.Option(False, "--logprobs", help="With --json: each token's log-probability."),
        device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
        tokenizer: Path | None = typer.Option(None, "--tokenizer", help="tokenizer.json (default: the source's)."),
        no_cache: bool = typer.Option(False, "--no-cache", help="Recompute every position each token (slow)."),
    ) -> None:
        """Continue prompts with a trained model. Exit 0 ok, 1 error."""
        from apr.generate.generate import GenerateOptions, generate
        from apr.generate.load import load_for_inference
        from apr.generate.sampling import Sampling

        _check_numbers(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                       repetition_penalty=repetition_penalty, seed=seed)
        origins: list[str] = []
        prompts = read_prompts(prompt, prompt_file, origins=origins)
        options = GenerateOptions(
            max_new_tokens=max_new_tokens, seed=seed, stop=tuple(stop), use_cache=not no_cache,
            logprobs=logprobs, stop_at_eos=not ignore_eos,
            sampling=Sampling(temperature=temperature, top_k=top_k, top_p=top_p,
                              repetition_penalty=repetition_penalty))
        if temperature == 0 and (top_k > 1 or top_p < 1 or seed is not None):
            typer.echo("warning: --temperature is 0 (greedy): --top-k, --top-p and --seed have no effect; "
                       "pass --temperature to sample", err=True)
        loaded = load_for_inference(source, tokenizer=tokenizer, device=device)
        for w in loaded.warnings:
            typer.echo(f"warning: {w}", err=True)

        stream = not json_out and len(prompts) == 1
        echoed = False

        def echo_prompt() -> None:  # once the prompt is encoded: a refused prompt is never echoed
            nonlocal echoed
            if not echoed:
                echoed = True
                sys.stdout.write(prompts[0])

        def on_text(_i: int, text: str) -> None:
            echo_prompt()
            sys.stdout.write(text)
            sys.stdout.flush()

        result = generate(loaded, prompts, options, on_text=on_text if stream else None, origins=origins)
        rate = result.tokens_per_s
        if json_out:
            doc = {
                "format_version": "1", "source": str(loaded.source), "kind": loaded.kind, "step": loaded.step,
                "device": str(loaded.device), "seed": result.seed,
                "settings": {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                             "top_p": top_p, "repetition_penalty": repetition_penalty, "stop": list(stop),
                             "greedy": options.sampling.is_greedy, "ignore_eos": ignore_eos},
                "generations": [g.to_dict() for g in result.generations],
                "prefill_s": round(result.prefill_s, 6), "decode_s": round(result.decode_s, 6),
                "tokens_per_s": round(rate, 2) if rate else None,
                "kv_cache_bytes_per_token": result.kv_cache_bytes_per_token,
            }
            typer.echo(json.dumps(doc, indent=2, ensure_ascii=False))
            return
        if stream:
            echo_prompt()
            sys.stdout.write("\n")
        else:
            for i, g in enumerate(result.generations):
                typer.echo(f"--- prompt {i + 1} ({g.finish_reason}, {len(g.token_ids)} tokens) ---")
                typer.echo(g.prompt + g.text)
        done = result.generations[0]
        how = f"{done.finish_reason}, {len(done.token_ids)} tokens" if stream else f"{len(prompts)} prompts"
        sampled = "" if options.sampling.is_greedy else f", seed {result.seed}"
        typer.echo(f"[{how}{sampled}, {rate:,.1f} tok/s]" if rate else f"[{how}{sampled}]", err=True)
