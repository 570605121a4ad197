from services.dashboard.picture import main

raise SystemExit(main())
