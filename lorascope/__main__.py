from lorascope.cli import main

main()
