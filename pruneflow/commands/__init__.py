"""The `pruneflow` commands, one module per command group, each registering its commands on the Typer app of
``app.py`` (with the option types, consoles and error table every command shares); ``cli.py`` (installed as
``pruneflow.cli``) imports them in the order ``--help`` lists them: optimize; validate and doctor (check); schema
and init (recipes); calibrate; inspect; bench."""
