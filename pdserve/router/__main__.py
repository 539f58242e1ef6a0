from pdserve.router.server import main

main()
