"""Checks around a load test: a preflight request per stage, greedy references and the greedy check.

Greedy decoding is deterministic, and every lossless strategy (speculative, block verification, MaG,
CS Drafting, SpecDec++) must give greedy autoregressive decoding's tokens exactly, under any load.  So a
greedy request's output is checked against a reference: by default one ``autoregressive`` request per
(prompt, ``max_new_tokens``, ``ignore_eos``) sent one at a time before the load starts, or the caller's
own expected token ids (``expected``, e.g. from the in-process engine).  A mismatch turns the request's
status into ``GREEDY_MISMATCH``: it counts as a failure.
"""
from __future__ import annotations

import dataclasses

from cluster.loadtest.clients import Caller, Target
from cluster.loadtest.spec import LoadSpec, RequestSpec

MISMATCH = "GREEDY_MISMATCH"
REFUSED = {"INVALID_ARGUMENT", "UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED", "NOT_FOUND",
           "400", "401", "403", "404", "405"}
UNREACHABLE = {"UNAVAILABLE", "CONNECTION_ERROR", "TIMEOUT", "DEADLINE_EXCEEDED", "503"}

Key = tuple[int, int, bool]          # (prompt index, max_new_tokens, ignore_eos)


class LoadTestError(RuntimeError):
    """The load test cannot run as asked (a refused preflight, no server, a failed reference)."""


def _where(target: Target, req: RequestSpec) -> str:
    return f"gRPC {target.grpc} (application {target.app!r})" if req.protocol == "grpc" else f"HTTP {target.http}"


def preflight(spec: LoadSpec, prompt: str, target: Target) -> None:
    """Send one 1-token request of each distinct stage request; raise :class:`LoadTestError` if the
    server refuses it (a bad strategy or option, a missing key) or nothing answers at the address."""
    seen: dict[RequestSpec, int] = {}
    for i, stage in enumerate(spec.stages):
        req = dataclasses.replace(stage.request, stream=False)
        key = dataclasses.replace(req, options=tuple(sorted(req.options.items())))
        if key in seen:
            continue
        seen[key] = i
        try:
            caller = Caller(target, req)
        except ValueError as e:
            raise LoadTestError(f"stage {i} ({stage.label}): {e}") from None
        try:
            out = caller.call(prompt, max_new_tokens=1)
        finally:
            caller.close()
        if out.status in REFUSED:
            raise LoadTestError(f"stage {i} ({stage.label}): {_where(target, req)} refused the request: "
                                f"{out.status}: {out.error}")
        if out.status in UNREACHABLE:
            raise LoadTestError(f"no server answering at {_where(target, req)}: {out.status}: {out.error}")


def greedy_keys(spec: LoadSpec, n_prompts: int) -> list[Key]:
    """Every (prompt, max_new_tokens, ignore_eos) a greedy stage may send."""
    shapes = sorted({(s.request.max_new_tokens, s.request.ignore_eos) for s in spec.stages if s.request.greedy})
    return [(p, m, e) for m, e in shapes for p in range(n_prompts)]


def greedy_references(spec: LoadSpec, prompts: list[str], target: Target,
                      strategy: str = "autoregressive") -> dict[Key, list[int]]:
    """Token ids of each greedy key, one ``strategy`` request at a time (gRPC if the target has it)."""
    keys = greedy_keys(spec, len(prompts))
    if not keys:
        return {}
    base = next(s.request for s in spec.stages if s.request.greedy)
    protocol = "grpc" if target.grpc else "http"
    req = dataclasses.replace(base, protocol=protocol, stream=False, strategy=strategy, options={}, seed=None)
    caller = Caller(target, req)
    refs = {}
    try:
        for p, m, e in keys:
            caller.req = dataclasses.replace(req, ignore_eos=e)
            out = caller.call(prompts[p], max_new_tokens=m, temperature=0.0)
            if out.status != "OK":
                raise LoadTestError(f"greedy reference for prompt {p} ({strategy}, {m} tokens) failed: "
                                    f"{out.status}: {out.error}")
            refs[(p, m, e)] = out.token_ids
    finally:
        caller.close()
    return refs


def check_greedy(records: list[dict], expected: dict[Key, list[int]]) -> tuple[int, int]:
    """Compare every successful greedy record that has a reference; mark mismatches ``GREEDY_MISMATCH``
    (keeping the server's status in ``status_before``).  Returns (checked, mismatched)."""
    checked = mismatched = 0
    for r in records:
        if r["status"] != "OK" or not r.get("greedy"):
            continue
        ref = expected.get((r["prompt"], r["max_new_tokens"], r["ignore_eos"]))
        if ref is None:
            continue
        checked += 1
        r["greedy_checked"] = True
        if list(r["token_ids"] or []) != list(ref):
            mismatched += 1
            r["status_before"], r["status"] = r["status"], MISMATCH
            r["error"] = f"greedy output differs from the reference ({len(r['token_ids'] or [])} vs {len(ref)} tokens)"
    return checked, mismatched
