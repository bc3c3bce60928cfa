from orin.cli.app import main

main()
