"""Mutation testing of ``impl/`` by Cosmic Ray (an outside tool): session configurations and helpers.

* ``checks/lab/mutation/<module>.toml``: one Cosmic Ray 8.7 session per ``impl/`` module, each
  running the gate's fast subset on the tiny model with one sequential local worker;
* :mod:`.annotation_filter`: marks mutants that only rewrite a PEP 563 annotation as skipped
  (equivalent by construction);
* :mod:`.report`: per-module counts, per-mutant records, and a re-check of the survivors under
  the gate checks added to kill them;
* :mod:`.screen_profile`: a pytest plugin registering a small derandomized Hypothesis profile
  (``mutation-screen``) for fast screens;
* ``checks/lab/mutation/pytest_fork.py``: a pre-imported pytest launcher (one fork per run) that
  ``policy.toml`` runs its screen through.

Needs the ``mutation`` extra (``pip install -e '.[mutation]'``).  Results and the survivor
analysis: docs/results/mutation.md.
"""
