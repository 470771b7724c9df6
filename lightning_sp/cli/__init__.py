"""The commands: ``lightning-sp fit | validate | test | estimate | prepare | generate | export |
calibrate | step-check`` (:mod:`lightning_sp.cli.main`), one module per command, the one-line
error parser (:mod:`~lightning_sp.cli.parser`) and the checks run before launch
(:mod:`~lightning_sp.cli.checks`)."""
