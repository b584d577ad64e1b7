from zplan.cli import app

app()
