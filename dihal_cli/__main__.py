from dihal_cli.main import app

app(prog_name="dihal")
