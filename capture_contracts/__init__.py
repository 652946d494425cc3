"""The contracts every package of the project shares, each with one home.

- :mod:`capture_contracts.errors` — the base of every package's exception tree, and format errors;
- :mod:`capture_contracts.vocabulary` — roles, call and episode states, marks, fallback reasons;
- :mod:`capture_contracts.bundle` — the episode bundle (``capture-episode/v1``): parse, serialise;
- :mod:`capture_contracts.rows` — the training row (``Row``, ``Span``) and its Parquet columns;
- :mod:`capture_contracts.drift` — the re-tokenisation drift report.

Nothing here does I/O or imports the service, the learner or an ML stack (numpy only; pyarrow is
imported by the one function that builds a Parquet table).
"""
