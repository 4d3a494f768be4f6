// The ECharts the report inlines: only what lorascope/report/assets/report.js draws with
// (its chart types, components and renderer), built by build.sh. A chart type or component
// report.js starts to use must be added here; the browser test
// test_every_component_a_chart_names_is_in_the_echarts_build says which is missing.
import { use } from "echarts/core";
import { BarChart, CustomChart, LineChart, ScatterChart } from "echarts/charts";
import {
  AxisPointerComponent,
  DataZoomComponent,
  GridComponent,
  LegendComponent,
  MarkAreaComponent,
  MarkLineComponent,
  ToolboxComponent,
  TooltipComponent,
  VisualMapContinuousComponent,
} from "echarts/components";
import { CanvasRenderer } from "echarts/renderers";

use([
  CanvasRenderer,
  LineChart,
  BarChart,
  ScatterChart,
  CustomChart,
  GridComponent,
  TooltipComponent,
  AxisPointerComponent,
  ToolboxComponent,
  LegendComponent,
  DataZoomComponent,
  VisualMapContinuousComponent,
  MarkLineComponent,
  MarkAreaComponent,
]);

export * from "echarts/core";
