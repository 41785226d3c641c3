"""``decodespec docs --out DIR``: build the reviewer docs site (HTML) from the spec registries.

Exit codes (see :mod:`decodespec.checks.commands.cli`): 0 built with no warning and complete coverage;
1 Sphinx warned (warnings are errors) or a rule / code is undocumented, documented twice or
unknown; 3 Sphinx, MyST or Graphviz ``dot`` is missing, or the hand-written pages are absent.

Source: issue 10; :mod:`decodespec.checks.docs.pages`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``docs`` subcommand."""
    p = subparsers.add_parser(
        "docs",
        help="build the reviewer docs (HTML) generated from the spec registries",
        description="Generate the rule, invariant, error-code, envelope, policy, ladder, failure-lab and "
        "results pages from the registries and build the HTML site with Sphinx (warnings are errors).",
    )
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="output folder for the HTML site")
    p.add_argument("--results", type=Path, metavar="DIR", default=None,
                   help="folder of conformance / failure-lab reports (*.jsonl); default docs/results")
    p.add_argument("--keep-source", type=Path, metavar="DIR", default=None,
                   help="also keep the staged MyST sources (hand-written + generated pages) in DIR")
    return p


def run(args: argparse.Namespace) -> int:
    """Build the site; print where it is and any problem."""
    from decodespec.checks.docs.pages import DocsError, build_site

    try:
        result = build_site(args.out, results_dir=args.results, source_dir=args.keep_source)
    except DocsError as exc:
        print(f"decodespec docs: {exc}", file=sys.stderr)
        return 3 if exc.missing_component else 1
    for line in result.warnings:
        print(line, file=sys.stderr)
    for problem in result.coverage.problems():
        print(f"coverage: {problem}", file=sys.stderr)
    print(f"{'built' if result.ok else 'FAILED'}: {result.out_dir / 'index.html'}")
    return 0 if result.ok else 1
