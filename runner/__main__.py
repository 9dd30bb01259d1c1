from runner.entry import main

main()
