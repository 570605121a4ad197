from services.soak.main import main

raise SystemExit(main())
