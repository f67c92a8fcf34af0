from specexport.cli import main

if __name__ == "__main__":  # not when a spawned process (bench peers) imports it
    main()
