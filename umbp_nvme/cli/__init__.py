"""The command line, ``umbp-nvme`` (docs/cli.md), and the tools it runs.

- ``main.py``: the command (the subcommands' arguments, ``main``: messages and exit codes) and
  ``commands.py`` (what each store subcommand does, one ``cmd_*`` each);
  ``drives.py`` (a command over several roots: once per drive, outputs combined) and ``paths.py``
  (store-path checks and messages, the installed docs);
- warm-up: ``warmup.py`` (the import), ``sources.py`` (what it imports from),
  ``hicache_files.py`` (SGLang's HiCacheFile directories), ``replay.py`` (prompts to a live server);
- ``archive.py`` (the archive format), ``export.py`` (``umbp-nvme export``), ``maintenance.py`` (offline stats, verify,
  compact, inspect), ``demo.py``; ``doctor`` prints the report of ``umbp_nvme/doctor/`` (the SGLang
  backend logs the same report at start when asked, so it lives below both).

Run as ``umbp-nvme`` (the console script: ``umbp_nvme.cli.main:main``) or ``python -m
umbp_nvme.cli``. Nothing is imported here, so ``import umbp_nvme.cli.archive`` costs only that module.
"""
