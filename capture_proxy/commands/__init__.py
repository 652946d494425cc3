"""The ``capture-proxy`` sub-commands of the service, one module each (``main(argv) -> int``)."""
