from specexport.cli import main

main()
