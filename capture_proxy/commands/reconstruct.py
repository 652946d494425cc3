"""``capture-proxy reconstruct``: a bundle file → rows (the pure core's CLI, ``reconstruct.cli``),
or, with ``--db URL``, the reconstruction job over the store (``capture_proxy.reconstruct_job``)."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    if "--db" in argv or any(arg.startswith("--db=") for arg in argv):
        from capture_proxy.reconstruct_job import main as job_main

        return job_main(argv)
    from reconstruct.cli import main as bundle_main

    return bundle_main(argv)
