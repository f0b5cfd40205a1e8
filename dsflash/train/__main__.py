from dsflash.train.run import main

main()
