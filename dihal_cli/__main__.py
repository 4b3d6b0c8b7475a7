from dihal.cli.main import main

main()
