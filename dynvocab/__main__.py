from dynvocab.cli import main

main()
