"""``mlxspec tune``: this machine's costs and a model's acceptance, the depths they call for.

What is stored, per (machine, model), as JSON under ``<user data dir>/mlxspec/tune/<machine>/<model>.json``:

* ``verify_cost``: cost of a target forward over n = 1..16 tokens, relative to one token;
* ``plain_step``: a pipelined plain token (the next forward queued while the host reads one)
  in the same unit (1 where not measured; an older record without it reads as 1);
* ``draft_cost``: cost of one draft step per drafter, in the same unit (prompt lookup: 0);
* ``acceptance``: per drafter and prompt kind, how often each draft position (1..8) was reached
  and accepted when drafting at a fixed depth 8 with the gates off (greedy);
* ``depth``: per drafter, the depth k with the best :func:`~mlxspec.engine.gates.expected_speedup`
  (the gates' own formula), with the relative speed per depth.

:mod:`.storage` reads and writes these records (``SpecModel.verify_cost()`` reads the stored
curve instead of measuring it again, and stores the curve it had to measure as a record of
``source`` "run", without acceptance or depths), :mod:`.measure` produces them, :mod:`.choice`
turns one into a run's drafter (for ``auto``) and depth cap, :mod:`.prompts` holds the
prompts acceptance is measured on. Showing them is the CLI's job (``mlxspec.cli.tune_report``).
The package imports nothing itself, so reading a record never loads the measuring code.
"""
