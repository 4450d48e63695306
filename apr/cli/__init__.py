"""The typer command line. Modules here parse, call one library function and render.

One naming scheme: ``cmd_<group>.py`` (``cmd_data``, ``cmd_runs``, ...) or ``cmd_<group>_<command>.py``
(``cmd_train_plan``) holds a command's ``register(app)``; ``main`` builds the app and is the one place
an ``AprError`` is shown (``render.print_error``); ``entry`` is the typer-free console script;
``help`` (metavars), ``render``, ``table`` and ``progress`` are shared rendering helpers (numbers: ``apr.fmt``)."""
