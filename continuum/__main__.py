from continuum.cli import main

main()
