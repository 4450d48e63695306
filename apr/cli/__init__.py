"""The typer command line. Modules here parse, call one library function and render."""
