"""Petals' command module names: ``python -m petals_core.cli.run_server`` is
``python -m petals_core.server``, and ``python -m petals_core.cli.run_dht`` is
``python -m petals_core.dht``, with the same flags."""
